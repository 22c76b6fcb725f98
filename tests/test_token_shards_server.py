"""token_shards on a real server: every format serves exactly its files' windows, and four
ranks read each window of an epoch exactly once, also across a resume at another world size."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from client_process import ClientProcess
from support.token_files import write_llmc, write_megatron, write_prepared, write_raw

from conftest import SUPPORT, ServerFactory, subprocess_env

T = 8
VOCAB = 2000
ELASTIC_B, ELASTIC_NB = 2, 5  # rows per file: 10


def windows_of(ids: np.ndarray) -> list[tuple[int, ...]]:
    """nanoGPT's windows at stride T, read with numpy: what the server must serve."""
    return [tuple(ids[k * T : k * T + T + 1].tolist()) for k in range((len(ids) - 1) // T)]


def formats_corpus(d: Path) -> tuple[list[str], list[tuple[int, ...]]]:
    """One file per format, ids distinct across files; the inputs and every window."""
    d.mkdir()
    raw = write_raw(d / "raw.bin", np.arange(0, 90, dtype=np.uint16))
    llmc = write_llmc(d / "fineweb_train_000001.bin", np.arange(100, 177))
    np.save(d / "arr.npy", np.arange(200, 265, dtype=np.uint16))
    mega = write_megatron(d / "mega", [np.arange(300, 340), np.arange(340, 401)])
    prep = write_prepared(
        d / "prep",
        [[np.arange(500, 560)], [np.arange(600, 650), np.arange(650, 671)]],
        vocab_size=VOCAB,
    )
    expected = (
        windows_of(np.fromfile(raw, dtype=np.uint16))
        + windows_of(np.fromfile(llmc, dtype=np.uint16, offset=1024))
        + windows_of(np.load(d / "arr.npy"))
        + windows_of(np.fromfile(mega, dtype=np.uint16))
        + windows_of(np.load(prep / "shard-000000.npy"))
        + windows_of(np.load(prep / "shard-000001.npy"))
    )
    inputs = [str(raw), str(llmc), str(d / "arr.npy"), str(mega.with_suffix(".idx")), str(prep)]
    return inputs, expected


def elastic_corpus(d: Path) -> tuple[list[str], list[int]]:
    """Six raw shards of uneven lengths; ids are positions, so x[0] names the window."""
    d.mkdir()
    lengths, first, starts = [57, 81, 9, 130, 66, 300], 0, []
    for i, n in enumerate(lengths):
        write_raw(d / f"s{i}.bin", np.arange(first, first + n, dtype=np.uint16))
        starts += [first + k * T for k in range((n - 1) // T)]
        first += n
    return [str(d / "s*.bin")], starts


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("token_shards")
    inputs, expected = formats_corpus(tmp / "formats")
    elastic_inputs, elastic_starts = elastic_corpus(tmp / "elastic")
    counter = iter(range(1, 10_000))
    documents = write_prepared(
        tmp / "documents",
        [[np.array([next(counter) for _ in range(k)] + [0]) for k in (3, 9, 14, 5, 11, 7)]] * 2,
        vocab_size=VOCAB,
        eos_id=0,
    )
    config = textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.formats]
        provider = "token_shards"
        batch_size = 4
        batches_per_file = 3
        [datasets.formats.args]
        inputs = {json.dumps(inputs)}
        block_size = {T}
        vocab_size = {VOCAB}
        [datasets.elastic]
        provider = "token_shards"
        batch_size = {ELASTIC_B}
        batches_per_file = {ELASTIC_NB}
        seed = 3
        [datasets.documents]
        provider = "token_shards"
        batch_size = 4
        batches_per_file = 2
        [datasets.documents.args]
        inputs = ["{documents.as_posix()}"]
        block_size = {T}
        order = "documents"
        [datasets.elastic.args]
        inputs = {json.dumps(elastic_inputs)}
        block_size = {T}
        vocab_size = {VOCAB}
        """
    )
    factory = ServerFactory(tmp)
    server = factory(config)
    yield server, tmp, expected, elastic_starts
    factory.close()


def start_rank(
    address: str,
    dataset: str,
    rank: int,
    world: int,
    batches: int,
    out: Path,
    state_in: str = "-",
    state_out: str | None = None,
) -> ClientProcess:
    args = [
        address,
        dataset,
        str(rank),
        str(world),
        str(batches),
        str(out),
        state_in,
    ]
    if state_out:
        args.append(state_out)
    return ClientProcess(SUPPORT / "window_client.py", args)


def finish(procs: list[ClientProcess]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_format_serves_exactly_its_windows_once_per_epoch(served) -> None:
    server, tmp, expected, _ = served
    batches = -(-2 * len(expected) // 4)  # two epochs
    out = tmp / "formats.jsonl"
    finish([start_rank(server.address, "formats", 0, 1, batches, out)])
    rows = [tuple(r) for line in read_lines(out) for r in line["rows"]]
    n = len(expected)
    for epoch in range(2):
        got = rows[epoch * n : (epoch + 1) * n]
        assert Counter(got) == Counter(expected)  # each window, byte for byte, exactly once
    assert rows[:n] != rows[n : 2 * n]  # a new order each epoch


def test_four_ranks_then_two_read_each_window_once_per_epoch(served) -> None:
    server, tmp, _, starts = served
    n = len(starts)
    rows_per_file = ELASTIC_B * ELASTIC_NB
    # Four ranks read one file and two batches of the next each, and save their state.
    old = [tmp / f"old-r{r}.jsonl" for r in range(4)]
    finish([
        start_rank(server.address, "elastic", r, 4, ELASTIC_NB + 2, old[r], state_out=str(tmp / f"old-r{r}.state"))
        for r in range(4)
    ])  # fmt: skip
    states = [json.loads((tmp / f"old-r{r}.state").read_text()) for r in range(4)]
    (tmp / "all.state").write_text(json.dumps(states))
    # Two ranks resume from the four states: each takes two of the carried files 4..7 (three
    # batches left in each), which end the first epoch's rows, and one file more.
    assert 7 * rows_per_file < n <= 8 * rows_per_file
    per_rank = 2 * (ELASTIC_NB - 2) + ELASTIC_NB
    new = [tmp / f"new-r{r}.jsonl" for r in range(2)]
    finish(
        [
            start_rank(server.address, "elastic", r, 2, per_rank, new[r], str(tmp / "all.state"))
            for r in range(2)
        ]
    )
    by_row: dict[int, int] = {}
    for path in old + new:
        for line in read_lines(path):
            for i, row in enumerate(line["rows"]):
                global_row = line["seq"] * rows_per_file + line["offset"] * ELASTIC_B + i
                assert global_row not in by_row, f"row {global_row} served twice"
                by_row[global_row] = row[0]
                assert row == list(range(row[0], row[0] + T + 1))
    first_epoch = [by_row.get(r) for r in range(n)]
    assert None not in first_epoch, "a row of the first epoch was never served"
    assert sorted(first_epoch) == starts  # every window of the corpus exactly once


def test_documents_with_an_eos_id_serve_text_lms_fields_to_a_client(served) -> None:
    from queue_client import QueueClient

    server = served[0]
    with QueueClient(server.address, "documents", timeout_s=60) as client:
        assert client.meta["eos_id"] == 0
        for _ in range(5):
            batch = client.get_batch("train")
            assert sorted(batch) == ["attention_mask", "input_ids", "labels", "segment_ids"]
            ids, labels = batch["input_ids"], batch["labels"]
            assert ids.shape == (4, T)
            assert bool(((labels == -100) == (ids == 0)).all())
            assert int(batch["segment_ids"].max()) >= 1


def test_bad_shards_fail_their_dataset_naming_the_file_and_the_fault(tmp_path: Path) -> None:
    """One server kept up (--keep-serving) with one fault per dataset and one good dataset:
    each bad one fails with an error naming its file and what is wrong, writes no meta, and
    the good one serves."""
    from queue_client import QueueClient
    from queue_server.testing import ServerProcess, wait_until

    d = tmp_path / "bad"
    d.mkdir()
    good = write_llmc(d / "good.bin", np.arange(200) % VOCAB)
    cases = {  # dataset: (file, extra args, what the message says)
        "magic": (write_llmc(d / "magic.bin", np.zeros(50), magic=7), 'format = "llmc"', "has magic 7 where an llm.c shard has 20240520"),
        "version": (write_llmc(d / "version.bin", np.zeros(50), version=2), "", "is llm.c shard version 2"),
        "truncated": (d / "truncated.bin", "", "but its header says 50 tokens"),
        "dtype": (d / "wide.npy", 'token_dtype = "uint16"', "holds uint32 tokens but token_dtype = 'uint16'"),
    }  # fmt: skip
    data = write_llmc(d / "truncated.bin", np.zeros(50)).read_bytes()
    (d / "truncated.bin").write_bytes(data[:-10])
    np.save(d / "wide.npy", np.zeros(50, np.uint32))
    text = "[server]\nlease_ttl_s = 30\n"
    for name, (path, extra, _) in {**cases, "good": (good, "", "")}.items():
        text += textwrap.dedent(
            f"""
            [datasets.{name}]
            provider = "token_shards"
            batch_size = 2
            batches_per_file = 2
            [datasets.{name}.args]
            inputs = ["{path.as_posix()}"]
            block_size = {T}
            {extra}
            """
        )
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=text,
        args=("--metrics-listen", "127.0.0.1:0", "--keep-serving"),
        env=subprocess_env(),
    )
    try:
        server.wait_bound(60)
        errors = wait_until(
            lambda: (
                all(server.stats(n)["state"] == "failed" for n in cases)
                and {n: server.stats(n)["last_error"] for n in cases}
            ),
            120,
            "every bad dataset to fail",
        )
        with QueueClient(server.address, "good", timeout_s=60) as client:
            x, _ = client.get_batch("train")
            assert x.shape == (2, T)
    finally:
        server.stop()
    for name, (path, _, expect) in cases.items():
        assert expect in errors[name] and path.name in errors[name], (name, errors[name])
        assert not (tmp_path / "data" / name / "meta.pkl").exists()
