"""What the workers' forkserver imports before it forks any worker: worker_main (torch and the
providers, a second or more of CPU), abandoned at once if the server that started it is gone.

The server starts the forkserver first thing, so that its import runs beside the server's own
start. A server that exits early (a config error, a data root in use, a kill) would otherwise
leave it importing to the end, seconds on a busy machine, before it notices. A thread watches
the forkserver's parent for as long as the import runs, and is gone before the first fork.
"""

from __future__ import annotations

import os
import threading

# How often the import's watcher looks for the server; a wake-up costs microseconds.
_POLL_S = 0.05


def _exit_when_orphaned(parent: int, imported: threading.Event) -> None:
    while not imported.wait(_POLL_S):
        if os.getppid() != parent:  # re-parented: the server is gone
            os._exit(0)


# A worker is one thread of work (worker_main sets torch's threads to 1: parallelism comes
# from worker processes). numpy's OpenBLAS reads its thread count when it loads, in the
# preload below, and would otherwise start a thread per core for a matrix-vector product
# (a curriculum composer's bounds). A count the environment sets is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_imported = threading.Event()
_watcher = threading.Thread(
    target=_exit_when_orphaned,
    args=(os.getppid(), _imported),
    name="forkserver-preload-watch",
    daemon=True,
)
_watcher.start()
try:
    import queue_server.production.worker_main  # noqa: F401  (the preload itself)
finally:
    _imported.set()
    _watcher.join()
