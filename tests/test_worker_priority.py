"""worker_priority: provider workers that take no core the trainer wants (SCHED_IDLE), by
choice, and the default that leaves them as every other process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import char_config
from queue_client import QueueClient
from queue_client.errors import ConfigError
from queue_server.config.server import load_config
from queue_server.production.priority import apply_worker_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid`."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _worker_pids(server, split: str) -> list[int]:
    return [int(p) for p in server.split_stats("chars", split)["worker_pids"]]


def test_idle_workers_run_in_sched_idle_and_the_server_does_not(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, extra='workers = 2\nworker_priority = "idle"'))
    server.wait_ready_files("chars", 2)
    with QueueClient(server.address, "chars") as client:
        client.get_batch("train")
        client.get_batch("val")  # val's worker starts on its first lease: idle too
    workers = _worker_pids(server, "train") + _worker_pids(server, "val")
    assert len(workers) == 3
    for pid in workers:  # every thread, also those the provider started after init
        assert _policies(pid) == {os.SCHED_IDLE}, pid
    assert _policies(server.pid) == {os.SCHED_OTHER}


def test_workers_keep_the_normal_class_by_default(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus))
    server.wait_ready_files("chars", 1)
    for pid in _worker_pids(server, "train"):
        assert _policies(pid) == {os.SCHED_OTHER}


def test_an_unknown_priority_is_refused_naming_the_key(tmp_path: Path, corpus: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(char_config(corpus, extra='worker_priority = "low"'))
    with pytest.raises(ConfigError, match=r"datasets\.chars\.worker_priority.*'low'"):
        load_config(path)


def test_a_priority_the_process_cannot_apply_says_which(monkeypatch) -> None:
    """A sandbox that forbids sched_setscheduler: the worker's error names the setting."""

    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with pytest.raises(ConfigError, match=r'worker_priority = "idle".*Operation not permitted'):
        apply_worker_priority("idle")
    apply_worker_priority("normal")  # asks nothing of the system
