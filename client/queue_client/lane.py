"""A stream's background threads, handed their work with one queue put each.

At a file switch the trainer's thread hands off the fetch of a file further ahead and the
release of the one it finished. A ThreadPoolExecutor.submit costs it tens of microseconds of
Python (a work item, a semaphore, a wake-up, all under the GIL) and wakes a pool thread that
runs the pool's own bookkeeping before the job; here a hand-off is one `SimpleQueue.put` (a
C call of about a microsecond) to threads already waiting on the queue, which run the job and
nothing else. The threads start with the stream, so no switch ever starts one, and `close`
runs every job already handed over (a finished file's release included) before it returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue

from queue_client import errors

log = logging.getLogger("queue_client")

Job = Callable[[], None]


class Lane:
    """`threads` threads running the jobs put on one queue, in the order they were put."""

    def __init__(self, name: str, threads: int, owner: str) -> None:
        if threads < 1:
            raise ValueError(f"a lane needs at least one thread, got {threads}")
        self.name = name
        self.owner = owner  # what the threads work for, named in errors
        self._jobs: SimpleQueue[Job | None] = SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def put(self, job: Job) -> None:
        """Hand `job` to the threads (it runs soon after, on one of them)."""
        if self._closed:
            raise errors.InvalidRequest(f"{self.owner} was closed: it fetches no more files")
        self._jobs.put(job)

    def close(self) -> None:
        """Run every job handed over so far, then end the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def _run(self) -> None:
        get = self._jobs.get
        while True:
            job = get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job reports its own errors; this is a last resort
                log.exception("background job of %s failed", self.name)
            # Drop the job before waiting for the next: it may hold a finished file, whose
            # unmapping belongs here, not to whoever puts the next job.
            job = None
