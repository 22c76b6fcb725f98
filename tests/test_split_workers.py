"""Worker processes per split: the training split gets `workers`, any other split (val) one,
unless `split_workers` names it. Checked on the config and on a real server's worker pids."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import char_config
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_server.config.dataset import dataset_from_table, training_split
from queue_server.testing import wait_until

BASE = {"provider": "char_lm", "batch_size": 4, "args": {"block_size": 8}}


def test_the_training_split_gets_workers_and_the_others_one() -> None:
    config = dataset_from_table("d", {**BASE, "workers": 4})
    assert config.workers_for("train", ["train", "val"]) == 4
    assert config.workers_for("val", ["train", "val"]) == 1
    assert config.workers_for("test", ["train", "val", "test"]) == 1
    # Without a "train" split the first one trains; a name that is no split (the meta
    # builder) keeps `workers`.
    assert training_split(["a", "b"]) == "a"
    assert config.workers_for("a", ["a", "b"]) == 4 and config.workers_for("b", ["a", "b"]) == 1
    assert config.workers_for("meta", []) == 4


def test_split_workers_sets_any_split_explicitly() -> None:
    config = dataset_from_table(
        "d", {**BASE, "workers": 4, "split_workers": {"val": 3, "train": 2}}
    )
    assert config.workers_for("val", ["train", "val"]) == 3
    assert config.workers_for("train", ["train", "val"]) == 2


@pytest.mark.parametrize(
    ("split_workers", "named"),
    [
        ({"val": 0}, "datasets.d.split_workers.val = 0"),
        ({"val": "2"}, "datasets.d.split_workers.val = '2'"),
        ({"val": True}, "datasets.d.split_workers.val = True"),
        ({"../x": 1}, "datasets.d.split_workers"),
        ([2], "datasets.d.split_workers = [2]"),
    ],
)
def test_bad_split_workers_are_refused_naming_the_key(split_workers: object, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        dataset_from_table("d", {**BASE, "split_workers": split_workers})
    assert named in str(info.value)


def test_the_fingerprint_follows_the_workers_of_every_split() -> None:
    one = dataset_from_table("d", BASE)
    # One worker everywhere, said or not: the same files, the same fingerprint as before
    # split_workers existed.
    assert dataset_from_table("d", {**BASE, "split_workers": {"val": 1}}).fingerprint() == (
        one.fingerprint()
    )
    assert dataset_from_table("d", {**BASE, "split_workers": {"val": 2}}).fingerprint() != (
        one.fingerprint()
    )
    two = dataset_from_table("d", {**BASE, "workers": 2})
    assert (
        dataset_from_table("d", {**BASE, "workers": 2, "split_workers": {"val": 2}}).fingerprint()
        != two.fingerprint()
    )


def _pids(server, split: str) -> list[int]:
    return [int(p) for p in server.split_stats("chars", split)["worker_pids"]]


def test_a_server_runs_one_val_worker_unless_told_otherwise(start_server, corpus: Path) -> None:
    """The training split's workers start with the server; val's one worker (or the
    split_workers it is told) starts on val's first lease."""
    server = start_server(char_config(corpus, extra="workers = 2"))
    wait_until(lambda: len(_pids(server, "train")) == 2, 60, "two train workers")
    assert _pids(server, "val") == []
    with QueueClient(server.address, "chars") as client:
        for _ in range(6):  # both splits serve, val from its one worker
            client.get_batch("train")
            client.get_batch("val")
    assert len(_pids(server, "val")) == 1
    server.stop()
    explicit = start_server(
        char_config(corpus, extra="workers = 2\nsplit_workers = { val = 3 }"),
        data_root=server.data_root.parent / "other-root",
    )
    with QueueClient(explicit.address, "chars") as client:
        client.get_batch("val")
    assert len(_pids(explicit, "val")) == 3
    wait_until(lambda: len(_pids(explicit, "train")) == 2, 60, "two train workers")
