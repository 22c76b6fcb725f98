"""A server that serves before its workers are up, splits that start their workers when first
read, and a backlog per split: what a loader should cost when half of it is never read."""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path

import pytest

from conftest import char_config
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_client.format.batchfile import BatchFileName
from queue_client.format.layout import DatasetLayout
from queue_server.config.dataset import dataset_from_table
from queue_server.testing import wait_until

BASE = {"provider": "char_lm", "batch_size": 4, "args": {"block_size": 8}}


def _pids(server, split: str) -> list[int]:
    return [int(p) for p in server.split_stats("chars", split)["worker_pids"]]


def _files(server, split: str) -> list[str]:
    directory = DatasetLayout(server.data_root, "chars").queue_dir(split)
    names = os.listdir(directory) if directory.exists() else []
    return sorted(n for n in names if BatchFileName.parse(n) is not None)


def _open_gate(gate: Path) -> bool:
    """Open and close the FIFO for writing, once a worker waits on it; False while none does."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader yet
            return False
        raise
    os.close(fd)
    return True


def _gated(gate: Path, workers: int = 1, per_worker: bool = False) -> str:
    """A dataset whose workers wait at their last start step for the test's FIFO `gate`
    (each worker for `gate`.N of its own with per_worker)."""
    return textwrap.dedent(
        f"""
        [datasets.gated]
        provider = "bq_start_providers:GatedStartProvider"
        batch_size = 2
        batches_per_file = 2
        workers = {workers}
        [datasets.gated.args]
        gate = "{gate}"
        per_worker = {str(per_worker).lower()}
        """
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="a FIFO")
def test_the_server_is_serving_before_its_workers_have_started(start_server, tmp_path) -> None:
    """The worker's last start step waits on a gate the test holds closed: the health service
    says SERVING while it waits, a lease waits for the worker, and the first batch comes once
    the gate opens. (Before, SERVING waited for every worker: wait_serving timed out.)"""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    server = start_server(_gated(gate), timeout_s=120)  # SERVING, the gate still shut
    assert server.split_stats("gated", "train")["ready_files"] == 0
    assert "started on its first lease" in server.log()  # val: no worker yet
    wait_until(lambda: _open_gate(gate), 60, "the train worker waiting on its gate")
    with QueueClient(server.address, "gated") as client:
        x, y = client.get_batch("train")
        assert x.shape == (2, 4) and bool((y == x + 1).all())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="a FIFO")
def test_a_slot_makes_its_first_file_while_another_worker_still_starts(
    start_server, tmp_path
) -> None:
    """Two train workers, each held at its last start step by a gate of its own. Once the
    first starts, its slot makes files while the second still waits, and a trainer reads
    them. (Before, no slot made a file until every worker had started: a first batch waited
    for the slowest worker's start.)"""
    gate = tmp_path / "gate"
    for worker in (0, 1):
        os.mkfifo(f"{gate}.{worker}")
    server = start_server(_gated(gate, workers=2, per_worker=True), timeout_s=120)
    wait_until(lambda: _open_gate(Path(f"{gate}.0")), 60, "train worker 0 waiting on its gate")
    server.wait_ready_files("gated", 1, timeout_s=60)  # slot 0's seq 0, slot 1 still shut
    with QueueClient(server.address, "gated") as client:
        first, _ = client.get_batch("train")
        assert first.shape == (2, 4)
        wait_until(lambda: _open_gate(Path(f"{gate}.1")), 60, "train worker 1 on its gate")
        for _ in range(3):  # the rest of seq 0, then seq 1: slot 1's, once it has started
            client.get_batch("train")


def test_a_split_nobody_reads_starts_no_worker_and_makes_no_file(
    start_server, corpus: Path
) -> None:
    server = start_server(char_config(corpus, extra="workers = 2"))
    server.wait_ready_files("chars", 2)  # train's workers are up and made files
    assert len(_pids(server, "train")) == 2
    assert _pids(server, "val") == [] and _files(server, "val") == []
    with QueueClient(server.address, "chars") as client:
        x, _ = client.get_batch("val")  # the first lease starts val's one worker
        assert x.shape == (4, 16)
    assert len(_pids(server, "val")) == 1


def test_split_max_backlog_files_bounds_each_split_on_disk(start_server, corpus: Path) -> None:
    """train keeps 4 ready files ahead of its reader, val 1: read alike (one batch each, then
    the reader waits), train's files on disk reach 6 and val's stop at 4 (its backlog beside
    the files its reader holds and prefetches), as with max_backlog_files = 1 for both."""
    extra = "max_backlog_files = 4\nsplit_max_backlog_files = { val = 1 }"
    server = start_server(char_config(corpus, extra=extra))
    with QueueClient(server.address, "chars") as client:
        client.get_batch("train")
        client.get_batch("val")
        assert server.split_stats("chars", "val")["max_backlog_files"] == 1
        assert server.split_stats("chars", "train")["max_backlog_files"] == 4

        def settled() -> bool:
            on_disk = {s: len(_files(server, s)) for s in ("train", "val")}
            stats = {s: server.split_stats("chars", s) for s in ("train", "val")}
            return on_disk["train"] >= 6 and all(
                on_disk[s] == stats[s]["ready_files"] + stats[s]["leased_files"] for s in stats
            )

        wait_until(settled, 60, "train's window on disk")
        train, val = len(_files(server, "train")), len(_files(server, "val"))
        assert val <= 4 < train, (train, val)
        # A release makes room in val for one more file, never more.
        client.get_batch("val")
        assert len(_files(server, "val")) <= val


def test_split_max_backlog_files_in_the_config() -> None:
    config = dataset_from_table(
        "d", {**BASE, "max_backlog_files": 4, "split_max_backlog_files": {"val": 1}}
    )
    assert config.backlog_for("train") == 4 and config.backlog_for("val") == 1
    # Not in the fingerprint: how far ahead files are made does not change them.
    assert config.fingerprint() == dataset_from_table("d", BASE).fingerprint()
    for bad, named in (
        ({"val": 0}, "datasets.d.split_max_backlog_files.val = 0"),
        (3, "datasets.d.split_max_backlog_files = 3"),
    ):
        with pytest.raises(ConfigError) as info:
            dataset_from_table("d", {**BASE, "split_max_backlog_files": bad})
        assert named in str(info.value)
