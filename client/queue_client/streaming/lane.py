"""A stream's background threads, handed their work with one queue put.

At a file switch the trainer's thread hands off the fetch of a file further ahead and the
release of the one it finished. A ThreadPoolExecutor.submit costs it tens of microseconds of
Python (a work item, a semaphore, all under the GIL) plus a wake-up per job, and wakes a pool
thread that runs the pool's own bookkeeping before the job. Here the jobs of one switch go in
one `SimpleQueue.put` (a C call) to threads already waiting on the queue: the trainer's thread
pays for one wake-up (a futex call, the part of a hand-off that costs most on a virtual
machine), and the thread it wakes hands the other jobs on before running the first. The
threads start with the stream, so no switch ever starts one, and `close` runs every job
already handed over (a finished file's release included) before it returns.

On Linux the threads run as SCHED_BATCH: woken by a hand-off (or by the GIL the trainer's
thread lets go inside a torch call), one waits for a free core or the scheduler's next turn
instead of preempting the thread that woke it, so the trainer keeps its core; the read-ahead
(readahead.py) is deep enough to absorb the later start. Their share of the CPU is unchanged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from queue import Empty, SimpleQueue

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

    def check_open(self) -> None:
        """Raise InvalidRequest, naming the owner, once the lane is closed."""
        if self._closed:
            raise errors.InvalidRequest(f"{self.owner} was closed: it fetches no more files")

    def put(self, job: Job) -> None:
        """Hand `job` to the threads (it runs soon after, on one of them)."""
        self.check_open()
        self._jobs.put(job)

    def put_all(self, jobs: Sequence[Job]) -> None:
        """Hand `jobs` over with one put: the thread that takes them puts the others back on
        the queue, for its fellows, and runs the first itself."""
        if len(jobs) == 1:
            self.put(jobs[0])
        elif jobs:
            self.put(partial(self._spread, list(jobs)))

    def stop(self) -> None:
        """End the threads once they have run every job handed over so far, without
        waiting for them (for an owner dropped unclosed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)

    def close(self) -> None:
        """Run every job handed over so far, then end the threads. Idempotent."""
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        # Jobs a spread put back behind the threads' last call.
        while True:
            try:
                job = self._jobs.get_nowait()
            except Empty:
                return
            if job is not None:
                self._call(job)

    def _spread(self, jobs: list[Job]) -> None:
        first = jobs[0]
        for job in jobs[1:]:
            self._jobs.put(job)
        jobs.clear()  # this frame keeps none of them alive while the first runs
        first()

    def _call(self, job: Job) -> None:
        try:
            job()
        except BaseException:  # a job reports its own errors; this is a last resort
            log.exception("background job of %s failed", self.name)

    def _run(self) -> None:
        yield_on_wakeup()
        get, call = self._jobs.get, self._call
        while True:
            job = get()
            if job is None:
                return
            call(job)
            # Drop the job before waiting for the next: it may hold a finished file, whose
            # unmapping belongs here, not to whoever puts the next job.
            job = None


def yield_on_wakeup() -> None:
    """Make the calling thread SCHED_BATCH where the platform has it (Linux): it never
    preempts a running thread when it wakes. Best effort: elsewhere, or where a sandbox
    forbids it, the thread keeps the default policy."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, on Linux
    except OSError as exc:
        log.debug("background thread keeps its scheduling policy: %s", exc)
