"""queue_server: the batchqueue gRPC server that owns the on-disk queues."""

from queue_server.app import QueueServer, create_server
from queue_server.config import DatasetConfig, ServerConfig, load_config, parse_config

__all__ = [
    "DatasetConfig",
    "QueueServer",
    "ServerConfig",
    "create_server",
    "load_config",
    "parse_config",
]
