"""The control plane's executor (steering/daemon_thread.py): calls run in order in one thread,
their results and errors reach the caller, pending ones are cancelled at shutdown, and a call
still blocked (the watcher's wait for a record) never holds the process's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from conftest import subprocess_env
from queue_server.steering.daemon_thread import DaemonThread


def test_calls_run_in_order_and_their_errors_reach_the_caller() -> None:
    runner = DaemonThread("test")
    seen: list[int] = []
    futures = [runner.submit(seen.append, i) for i in range(5)]
    assert [f.result(10) for f in futures] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    failed = runner.submit(int, "not a number")
    with pytest.raises(ValueError, match="not a number"):
        failed.result(10)
    runner.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        runner.submit(int, "1")


def test_shutdown_cancels_what_has_not_started() -> None:
    runner = DaemonThread("test")
    started, gate = threading.Event(), threading.Event()

    def first_call() -> bool:
        started.set()
        return gate.wait(30)

    first = runner.submit(first_call)
    later = runner.submit(int, "2")
    assert started.wait(30)
    runner.shutdown(wait=False, cancel_futures=True)
    assert later.cancelled()
    gate.set()
    assert first.result(10) is True  # the call running goes on to its end


def test_a_blocked_call_does_not_hold_the_exit() -> None:
    code = (
        "import time\n"
        "from queue_server.steering.daemon_thread import DaemonThread\n"
        "runner = DaemonThread('blocked')\n"
        "runner.submit(time.sleep, 120)\n"
        "time.sleep(0.2)\n"
        "runner.shutdown(wait=False, cancel_futures=True)\n"
    )
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", code], env=subprocess_env(), check=True, timeout=60)
    assert time.monotonic() - began < 30  # not the 120 s of the call still blocked
