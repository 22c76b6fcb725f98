"""A Ray actor killed while other processes keep every core of its machine busy is replaced
within seconds, not minutes.

Ray runs each actor in a worker process of its own, and a dead actor's replacement needs a new
one. Ray starts worker processes at niceness 15 unless told otherwise: where processes of
normal priority (trainers, say) keep every core busy, such a process gets about 1% of a core,
and a new actor took a minute and more to start while the dataset said it was "waiting for a
Ray node with 0 CPU free". The server's own Ray instance ("local") starts its workers at normal
priority, as the local backend's worker processes run, so a replacement gets its share of the
busy cores. Here the whole instance shares one core with BUSY_LOOPS processes that never
sleep: the replacement must serve within REFILL_S.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from auditor import audit
from ray_serving import BPF, in_order, positions, read_batches, read_out, reader, state_of

from conftest import ServerFactory, char_config, wait_until
from queue_server.production.ray.ray_calls import stall_message
from queue_server.testing import ServerProcess

# Normal-priority processes that keep the instance's core busy: about 0.6% of it is left for
# a worker at niceness 15 (weight 36 against 6 x 1024), a seventh for one at niceness 0.
BUSY_LOOPS = 6
# Files read after the kill: more than the backlog and the trainer's read-ahead hold, so that
# slot 0's new actor must make some of them.
AFTER = 10
# From the kill to those files read, at load 5-7 on 2 cores: 6-8 s for a worker at niceness
# 0; at niceness 15 no file of the new actor's within 40 s (4 busy processes: 58 s, 71 s).
REFILL_S = 40.0


@contextlib.contextmanager
def on_core(core: int) -> Iterator[None]:
    """Processes started meanwhile by this thread run on `core` alone (they and their
    children inherit the affinity)."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


@contextlib.contextmanager
def busy(core: int, loops: int) -> Iterator[None]:
    """`loops` processes of normal priority spinning on `core` until the block ends."""
    with on_core(core):
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)
        ]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait(timeout=30)


def unpin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` back on `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def slot_pids(server: ServerProcess) -> dict[int, int]:
    return {int(w["index"]): int(w["pid"]) for w in server.split_stats("chars")["workers"]}


def running(pids: dict[int, int]) -> dict[int, int]:
    """`pids` when train's two slots both have an actor that answered, else {}."""
    return pids if len(pids) == 2 and all(pids.values()) else {}


@pytest.mark.xdist_group("ray")  # a Ray instance of its own: not beside the session's
@pytest.mark.timeout(600)
def test_an_actor_killed_on_a_busy_core_is_replaced_within_seconds(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    """The server's Ray instance runs on one core; train's two actors made two files. Then
    BUSY_LOOPS normal-priority processes keep that core busy, the started actors serve two
    more files, and slot 0's actor is SIGKILLed: a trainer reading AFTER more files (some of
    them made by slot 0's new actor) gets them within REFILL_S, every seq once, and the
    dataset serves on with nothing to report."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchqueue[ray]'")
    cpus = os.sched_getaffinity(0)
    core = max(cpus)
    keys = 'backend = "ray"\nray_address = "local"\nworkers = 2\nmax_backlog_files = 2'
    with on_core(core):
        server = start_server(char_config(corpus, extra=keys), data_root=tmp_path / "data")
    try:
        rows = read_batches(server, "chars", 2 * BPF, tmp_path / "1.jsonl")
        pids = wait_until(lambda: running(slot_pids(server)), 120, "train's actors running")
        # The server itself runs where it likes again; its Ray instance stays on the core.
        unpin(server.pid, cpus)
        with busy(core, BUSY_LOOPS):
            rows += read_batches(
                server, "chars", 2 * BPF, tmp_path / "2.jsonl", state_of(tmp_path / "1.jsonl")
            )
            os.kill(pids[0], signal.SIGKILL)
            trainer = reader(
                server, "chars", AFTER * BPF, tmp_path / "3.jsonl", state_of(tmp_path / "2.jsonl")
            )
            try:
                _, err = trainer.communicate(timeout=REFILL_S)
            except subprocess.TimeoutExpired:
                trainer.kill()
                stats = server.split_stats("chars")
                raise AssertionError(
                    f"{AFTER} files not read within {REFILL_S:g} s of slot 0's actor's death: "
                    f"workers {stats['workers']}; last error "
                    f"{server.stats('chars')['last_error']!r}\n{server.log_tail()}"
                ) from None
            assert trainer.returncode == 0, f"the trainer failed ({trainer.returncode}):\n{err}"
        rows += read_out(tmp_path / "3.jsonl")
        assert positions(rows) == in_order(4 + AFTER)
        stats = audit(server, "chars", consumed_batches={"train": positions(rows)})["train"]
        assert stats["worker_restarts"] >= 1, stats
        now = slot_pids(server)
        assert now[0] not in (0, pids[0]) and now[1] == pids[1], (pids, now)
        dataset = server.stats("chars")
        assert (dataset["state"], dataset["last_error"]) == ("serving", ""), dataset
    finally:
        server.stop()  # the Ray instance stops with the server


def test_a_local_actors_wait_is_not_called_a_wait_for_a_free_cpu() -> None:
    """Actors of ray_address = "local" reserve no CPU, so no node lacks room for one: a long
    wait is its worker process starting, and the report says so."""
    reason = stall_message(40.0, 0.0, "spread", "chars/train slot 0")
    assert "CPU free" not in reason, reason
    assert reason.startswith("waiting 40 s for Ray to start the worker process of the actor "
                             "of chars/train slot 0"), reason  # fmt: skip
    assert "RAY_worker_niceness" in reason, reason
    cluster = stall_message(40.0, 1.0, "spread", "chars/train slot 0")
    assert "waiting 40 s for a Ray node with 1 CPU free (ray_placement = 'spread')" in cluster
    assert "RAY_worker_niceness" in cluster, cluster
