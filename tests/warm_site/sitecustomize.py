"""In a test's server process: multiprocessing starts its forkserver through the shim that
tests/warm_forkserver.py wrote, which has the tests' zygote fork it warm.

Set on multiprocessing.spawn's first import, so a process that never starts a child pays
nothing here but this check."""

from __future__ import annotations

import os
import sys
from typing import Any

_SHIM = os.environ.get("BATCHQUEUE_TESTS_FORKSERVER_SHIM")


class _PointSpawnAtShim:
    """A finder that only watches for multiprocessing.spawn, then leaves sys.meta_path."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "multiprocessing.spawn":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_point(module: Any) -> None:
            exec_module(module)
            module.set_executable(_SHIM)

        spec.loader.exec_module = exec_then_point  # type: ignore[method-assign]
        return spec


if _SHIM:
    sys.meta_path.insert(0, _PointSpawnAtShim())
