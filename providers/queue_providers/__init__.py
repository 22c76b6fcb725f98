"""Dataset providers for batchqueue: subclass DataProviderBase, or use a built-in one."""

from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.registry import BUILTIN, create, resolve
from queue_providers.seeding import derive_seed

__all__ = ["BUILTIN", "DataProviderBase", "ProviderContext", "create", "derive_seed", "resolve"]
