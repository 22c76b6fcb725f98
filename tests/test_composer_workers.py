"""composer_workers through a real server: one, two and three composers per curriculum split
serve the same stream to the byte (the same picks, the same files), whatever order their
answers come in; a composer killed mid-stream restarts with the others from the snapshot and
the stream does not change. The corpus is written by the test."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import ServerFactory, skewed_corpus, wait_until
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_server.config.server import parse_config, tomllib

NB = 8  # batches per file


def dataset(name: str, corpus: Path, composers: int) -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "char_lm"
        batch_size = 4
        batches_per_file = {NB}
        max_backlog_files = 1
        selection = "curriculum"
        candidate_buffer = 48
        curriculum_schedule = [[0, 1.0], [40, 0.0]]
        starting_estimation_token_count = 200000
        composer_workers = {composers}
        [datasets.{name}.args]
        input = "{corpus.as_posix()}"
        block_size = 32
        """
    )


def served_stream(
    client: QueueClient, batches: int, before: Callable[[int], None] | None = None
) -> str:
    """sha256 over the bytes of every served batch, in order, with an alpha change midway;
    `before(i)` runs before batch i is read."""
    digest = hashlib.sha256()
    for i in range(batches):
        if before is not None:
            before(i)
        if i == 3 * NB + 1:
            client.set_curriculum(0.5)
        x, y = client.get_batch("train")
        digest.update(x.numpy().tobytes())
        digest.update(y.numpy().tobytes())
    return digest.hexdigest()


def journaled_picks(root: Path, name: str) -> dict[int, list]:
    out = {}
    for line in (root / name / "journal" / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["e"] == "p":
            out[rec["seq"]] = rec["before"]["picks"]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("composers")
    corpus = skewed_corpus(tmp / "corpus.txt", segments=300, seed=11)
    config = "".join(
        [
            dataset("one", corpus, 1),
            dataset("two", corpus, 2),
            dataset("three", corpus, 3),
            dataset("killed", corpus, 3),
            dataset("twin", corpus, 1),
        ]
    )
    factory = ServerFactory(tmp)
    yield factory(config)
    factory.close()


def test_one_two_and_three_composers_serve_the_same_stream(server) -> None:
    batches = 9 * NB
    streams = {}
    for name in ("one", "two", "three"):
        with QueueClient(server.address, name) as client:
            streams[name] = served_stream(client, batches)
    assert streams["one"] == streams["two"] == streams["three"]
    picks = {name: journaled_picks(server.data_root, name) for name in streams}
    common = set.intersection(*(set(p) for p in picks.values()))  # composed ahead: timing
    assert len(common) >= 9
    assert all(picks["one"][s] == picks["two"][s] == picks["three"][s] for s in common)
    # Three composers are three processes, before the candidate providers.
    pids = server.split_stats("three")["worker_pids"]
    assert len(pids) == 3 + 1 and len(server.split_stats("one")["worker_pids"]) == 1 + 1


def test_a_killed_composer_restarts_with_the_others_and_the_stream_is_unchanged(server) -> None:
    """SIGKILL composer 1 of 3 while composition runs ahead of the trainer: all three restart
    from the last journaled snapshot, and the trainer reads what one composer serves."""
    killed: list[int] = []

    def kill_one(i: int) -> None:
        if i == 4 * NB + 2:
            killed.append(int(server.split_stats("killed")["worker_pids"][1]))
            os.kill(killed[0], signal.SIGKILL)

    with QueueClient(server.address, "killed") as client:
        stream = served_stream(client, 9 * NB, kill_one)
    wait_until(
        lambda: killed[0] not in map(int, server.split_stats("killed")["worker_pids"]),
        30,
        "a new composer in place of the killed one",
    )
    assert server.split_stats("killed")["worker_restarts"] >= 1
    with QueueClient(server.address, "twin") as client:
        assert stream == served_stream(client, 9 * NB)


@pytest.mark.parametrize(
    "value, shown", [("0", "0"), ("65", "65"), ("1.5", "1.5"), ('"two"', "'two'")]
)
def test_composer_workers_out_of_range_is_named(value: str, shown: str, tmp_path: Path) -> None:
    text = dataset("d", tmp_path / "corpus.txt", 1).replace(
        "composer_workers = 1", f"composer_workers = {value}"
    )
    with pytest.raises(ConfigError, match=re.escape(f"datasets.d.composer_workers = {shown} is")):
        parse_config(tomllib.loads(text), config_dir=tmp_path)


def test_composer_workers_is_not_in_the_fingerprint(tmp_path: Path) -> None:
    """A data dir built with one composer count serves with another: same batches."""
    one = parse_config(tomllib.loads(dataset("d", tmp_path / "c.txt", 1)), config_dir=tmp_path)
    three = parse_config(tomllib.loads(dataset("d", tmp_path / "c.txt", 3)), config_dir=tmp_path)
    assert one.datasets[0].fingerprint() == three.datasets[0].fingerprint()
    assert three.datasets[0].curriculum.composer_workers == 3
