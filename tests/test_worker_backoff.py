"""A provider worker that keeps dying is restarted with a backoff (at once the first time, then
0.5 s doubling to 30 s), shown in GetStats with its last failure; a file made resets it, and
the server keeps answering meanwhile."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from conftest import wait_until
from queue_client import QueueClient

SERVING = health_pb2.HealthCheckResponse.SERVING


def _config(provider: str, marker: Path | None, restarts: int = 50) -> str:
    args = f'marker = "{marker.as_posix()}"' if marker is not None else ""
    return textwrap.dedent(
        f"""
        [datasets.bad]
        provider = "{provider}"
        batch_size = 2
        batches_per_file = 2
        max_worker_restarts = {restarts}
        [datasets.bad.args]
        {args}
        [datasets.good]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 2
        """
    )


def test_a_worker_that_dies_on_every_file_is_restarted_less_and_less_often(start_server) -> None:
    """Restarts are counted while the backoff climbs to 4 s: a handful (the delays 0, 0.5, 1,
    2 and 4 s between them), where restarting at once would have made dozens in that time.
    Meanwhile GetStats and health answer at once and the other dataset serves batches."""
    server = start_server(_config("bq_test_providers:CrashingProvider", None), wait_serving=False)
    wait_until(lambda: server.stats("bad")["splits"], 60, "the splits to start")
    wait_until(lambda: server.split_stats("bad")["worker_restarts"] >= 1, 60, "a first restart")
    began = time.monotonic()
    stats = wait_until(
        lambda: (s := server.split_stats("bad"))["worker_backoff_s"] >= 4.0 and s,
        60,
        "the restart backoff to reach 4 s",
    )
    took = time.monotonic() - began
    # Restarts 2..5 waited 0.5 + 1 + 2 s before the one that now waits 4 s.
    assert took >= 3.0, f"restarts came too fast: backoff 4 s reached after {took:.1f}s"
    assert stats["worker_restarts"] <= 7, stats["worker_restarts"]
    assert "exited with code 17" in stats["last_worker_error"]
    assert server.stats("bad")["state"] != "failed"
    # Responsive while a split backs off: cheap calls answer at once, the other dataset serves.
    t0 = time.monotonic()
    server.stats("bad")
    assert server.health("batchqueue.v1.BatchQueue/good") == SERVING
    assert time.monotonic() - t0 < 2.0
    with QueueClient(server.address, "good", timeout_s=30) as client:
        x, y = client.get_batch("train")
        assert (y == x + 1).all()
    # Over the next window the spacing holds: at most one more restart in 3 s (it waits 4 s).
    before = server.split_stats("bad")["worker_restarts"]
    wait_until(lambda: time.monotonic() - t0 > 3.0, 10, "a 3 s window")
    assert server.split_stats("bad")["worker_restarts"] - before <= 1
    assert "slot 0: failure" in server.log() and "restarting it in" in server.log()


def test_a_worker_that_cannot_start_backs_off_and_a_good_file_resets_it(
    start_server, tmp_path: Path
) -> None:
    """A worker that dies while starting (its provider's on_start) is restarted with the same
    backoff; once it can start again and makes a file, the backoff is back to 0 and the last
    failure is still shown."""
    marker = tmp_path / "crash-at-start"
    server = start_server(_config("bq_backoff_providers:CrashAtStartProvider", marker))
    server.wait_ready_files("bad", 2)
    marker.touch()
    pid = int(server.split_stats("bad")["worker_pids"][0])
    os.kill(pid, signal.SIGKILL)
    stats = wait_until(
        lambda: (s := server.split_stats("bad"))["worker_backoff_s"] >= 1.0 and s,
        60,
        "the backoff to reach 1 s",
    )
    assert stats["worker_restarts"] >= 3
    assert "exited with code 19" in stats["last_worker_error"] or "code 19" in server.log()
    marker.unlink()
    # A trainer reads on: its files are made by a worker that started, which resets the backoff.
    with QueueClient(server.address, "bad", timeout_s=60) as client:
        for _ in range(8):
            client.get_batch("train")
    stats = wait_until(
        lambda: (s := server.split_stats("bad"))["worker_backoff_s"] == 0 and s,
        60,
        "the backoff to be reset",
    )
    assert stats["last_worker_error"], "the last failure stays visible after recovery"
    assert server.stats("bad")["state"] == "serving"
