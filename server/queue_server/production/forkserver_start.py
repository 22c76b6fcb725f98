"""The workers' forkserver context, in a module of its own: `queue-server` starts the
forkserver before anything else is imported (entry.py), and the forkserver's torch import
is the longest step of a first start, so nothing here may delay it (asyncio alone takes
tens of ms to import)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from multiprocessing.context import ForkServerContext

_context: ForkServerContext | None = None


def forkserver_context() -> ForkServerContext:
    """The one forkserver context of this process, preloading worker_main (torch, providers)."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["queue_server.production.forkserver_preload"])
        _context = ctx
    return _context


def start_forkserver() -> None:
    """Start the forkserver now (it imports torch and the providers on its own, seconds of
    CPU), so that this runs while the server binds and reads its journals, rather than
    when the first worker is asked for. Blocks only for the spawn."""
    forkserver_context()
    multiprocessing.forkserver.ensure_running()
