"""The workers' forkserver context, in a module of its own: `queue-server` starts the
forkserver before anything else is imported (entry.py), and the forkserver's imports (torch,
where a dataset's provider needs it) are the longest step of a first start, so nothing here
may delay it (asyncio alone takes tens of ms to import)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import threading
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext

_PRELOAD = "queue_server.production.forkserver_preload"
_PRELOAD_TORCH = "queue_server.production.forkserver_preload_torch"
# How often a preload's watcher looks for the server; a wake-up costs microseconds.
_POLL_S = 0.05

_context: ForkServerContext | None = None


def forkserver_context(preload_torch: bool = True) -> ForkServerContext:
    """The one forkserver context of this process, preloading worker_main and the providers'
    shared code, and torch first when `preload_torch` (worker_imports.py decides). The first
    call settles the preload."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([_PRELOAD_TORCH, _PRELOAD] if preload_torch else [_PRELOAD])
        _context = ctx
    return _context


def start_forkserver(preload_torch: bool = True) -> None:
    """Start the forkserver now (its imports are up to seconds of CPU), so that they run while
    the server binds and reads its journals, rather than when the first worker is asked for.
    Blocks only for the spawn. A forkserver already started keeps its preload."""
    forkserver_context(preload_torch)
    multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def abandoned_with_the_server() -> Iterator[None]:
    """In the forkserver, around a preload's import: exit at once if the server that started
    it goes away meanwhile (re-parented), rather than import to the end for nobody."""
    # A worker is one thread of work (worker_main sets torch's threads to 1: parallelism comes
    # from worker processes). numpy's OpenBLAS reads its thread count when it loads, in the
    # preload, and would otherwise start a thread per core for a matrix-vector product (a
    # curriculum composer's bounds). A count the environment sets is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parent, imported = os.getppid(), threading.Event()

    def exit_when_orphaned() -> None:
        while not imported.wait(_POLL_S):
            if os.getppid() != parent:  # re-parented: the server is gone
                os._exit(0)

    watcher = threading.Thread(target=exit_when_orphaned, name="forkserver-preload-watch")
    watcher.daemon = True
    watcher.start()
    try:
        yield
    finally:
        imported.set()
        watcher.join()
