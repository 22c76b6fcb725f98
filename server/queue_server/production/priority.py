"""How much CPU a provider worker takes from the trainer when both want a core.

A worker is ahead of the trainer by a backlog of files; the trainer's Python thread is on the
critical path of every step. On a node with fewer free cores than worker processes, the two
share cores, and a worker that holds one for the length of its time slice makes the trainer
wait that long, at a file switch or any call. `worker_priority = "idle"` puts every thread of
the worker in Linux's SCHED_IDLE class: it runs only on a core nothing else wants, and any
other task that wakes takes the core from it at once. Only a lowering of priority: it needs
no privilege, and it cannot be undone inside the process (raising it back needs
CAP_SYS_NICE), so it is set once, when the worker starts.

The risk is the other side: on a node whose cores other processes keep busy, an idle-class
worker runs almost never, and the trainer waits for its backlog. So "normal" is the default.
"""

from __future__ import annotations

import os

from queue_client.errors import ConfigError

PRIORITIES = ("normal", "idle")


def apply_worker_priority(priority: str, *, this_thread_only: bool = False) -> None:
    """Put every thread of this process (and the threads it starts later) in `priority`'s
    scheduling class; ConfigError naming the setting where the system refuses.
    `this_thread_only`: the calling thread and those it starts (a Ray actor's method thread,
    not Ray's own threads, whose heartbeats must not wait for a free core)."""
    if priority == "normal":
        return
    if priority != "idle":
        raise ConfigError(f"worker_priority must be one of {PRIORITIES}, got {priority!r}")
    if not hasattr(os, "SCHED_IDLE"):
        raise ConfigError(
            'worker_priority = "idle" needs Linux\'s SCHED_IDLE scheduling class, which this '
            'system lacks: use "normal"'
        )
    threads = [0]  # the calling thread, and those it starts from now on
    if not this_thread_only:
        try:
            threads = [int(tid) for tid in os.listdir("/proc/self/task")]
        except OSError:
            pass  # no /proc: the calling thread
    param = os.sched_param(0)
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, param)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            raise ConfigError(
                f'worker_priority = "idle": the system refused SCHED_IDLE for worker pid '
                f'{os.getpid()} ({exc.strerror}); use "normal" (a seccomp profile or a '
                "sandbox may forbid sched_setscheduler)"
            ) from None
