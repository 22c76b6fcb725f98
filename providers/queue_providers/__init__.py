"""Dataset providers for batchqueue: subclass DataProviderBase, or use a built-in one."""

from queue_providers.base import DataProviderBase, ProviderContext, derive_seed
from queue_providers.registry import BUILTIN, create, resolve

__all__ = ["BUILTIN", "DataProviderBase", "ProviderContext", "create", "derive_seed", "resolve"]
