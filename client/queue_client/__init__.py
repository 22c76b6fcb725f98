"""queue_client: what a training script imports to read batches from a batchqueue server.

from queue_client import QueueClient
client = QueueClient("localhost:50051", "stdlib_char", device="cuda")
X, Y = client.get_batch("train")
"""

from typing import TYPE_CHECKING, Any

from queue_client.errors import (
    BatchQueueError,
    ConfigError,
    CorruptBatchFile,
    InvalidRequest,
    LeaseConflict,
    MetaError,
    NoBatchReady,
    NotServed,
    PermissionDenied,
    ProviderFailed,
    SchemaMismatch,
    ServerBusy,
    ServerUnavailable,
    UnknownDataset,
    UnknownLease,
    UnknownSplit,
)
from queue_client.format.schema import FieldSpec
from queue_client.world import World

if TYPE_CHECKING:
    from queue_client.client import QueueClient
    from queue_client.dataset import QueueDataset
    from queue_client.legacy import LegacyClient

# Imported on first use, so that the server can use the on-disk format without torch.
_LAZY = {
    "LegacyClient": "queue_client.legacy",
    "QueueClient": "queue_client.client",
    "QueueDataset": "queue_client.dataset",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'queue_client' has no attribute {name!r}")


__all__ = [
    "BatchQueueError",
    "ConfigError",
    "CorruptBatchFile",
    "FieldSpec",
    "InvalidRequest",
    "LeaseConflict",
    "LegacyClient",
    "MetaError",
    "NoBatchReady",
    "NotServed",
    "PermissionDenied",
    "ProviderFailed",
    "QueueClient",
    "QueueDataset",
    "SchemaMismatch",
    "ServerBusy",
    "ServerUnavailable",
    "UnknownDataset",
    "UnknownLease",
    "UnknownSplit",
    "World",
]
