"""queue_server: the batchqueue gRPC server that owns the on-disk queues."""

from queue_server.app import QueueServer, create_server
from queue_server.config import DatasetConfig, ServerConfig, load_config, parse_config
from queue_server.inprocess import ServeError, serve, serve_async

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
