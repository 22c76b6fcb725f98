"""Processes that stand for trainers (rows 5 and 6), forked from one forkserver that imported
torch and the client once: starting four ranks then costs four forks, not four interpreters
importing torch on a 2-core machine. The forkserver never opens a gRPC channel, so every child
opens its own, as a fresh trainer process would.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

_context: BaseContext | None = None


def context() -> BaseContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["queue_client.client", "bench.trainer_loop", "bench.memory"])
        _context = ctx
    return _context
