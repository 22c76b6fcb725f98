"""An executor of one daemon thread, for the control plane's blocking store calls.

A ThreadPoolExecutor's threads are joined when the interpreter exits, so a call blocked in the
store kept a stopped server alive: the watcher waits up to a minute for the next record, and a
SIGTERM'd server lingered that long after "stopped" (long enough for a supervisor to SIGKILL
it). This thread does not hold the exit; what it was doing is of no use once the server stops.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class DaemonThread(Executor):
    """Runs the calls submitted to it one at a time, in order, in one daemon thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._thread.name}: cannot run calls after shutdown")
            self._jobs.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job[0].cancel()
            self._jobs.put(None)
        if wait:
            self._thread.join()
