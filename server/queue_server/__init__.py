"""queue_server: the batchqueue gRPC server that owns the on-disk queues.

The names below are imported on first use: a provider worker imports modules of this package
(queue_server.production.worker_main) and must not pay for gRPC and the server it never runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "QueueServer": "queue_server.app",
    "create_server": "queue_server.app",
    "DatasetConfig": "queue_server.config.server",
    "ServerConfig": "queue_server.config.server",
    "load_config": "queue_server.config.server",
    "parse_config": "queue_server.config.server",
    "ServeError": "queue_server.inprocess",
    "serve": "queue_server.inprocess",
    "serve_async": "queue_server.inprocess",
}

__all__ = [
    "DatasetConfig",
    "QueueServer",
    "ServeError",
    "ServerConfig",
    "create_server",
    "load_config",
    "parse_config",
    "serve",
    "serve_async",
]

if TYPE_CHECKING:
    from queue_server.app import QueueServer, create_server
    from queue_server.config.server import DatasetConfig, ServerConfig, load_config, parse_config
    from queue_server.inprocess import ServeError, serve, serve_async


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'queue_server' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
