"""Dataset providers for batchqueue: subclass DataProviderBase, or use a built-in one.

The names below are imported on first use (PEP 562), so a tool that needs one module of the
package (`queue-prepare`, a tokenizer trainer) and its worker processes start without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from queue_providers.base import DataProviderBase, ProviderContext
    from queue_providers.registry import BUILTIN, create, resolve
    from queue_providers.seeding import derive_seed

__all__ = ["BUILTIN", "DataProviderBase", "ProviderContext", "create", "derive_seed", "resolve"]

_HOMES = {
    "BUILTIN": "queue_providers.registry",
    "DataProviderBase": "queue_providers.base",
    "ProviderContext": "queue_providers.base",
    "create": "queue_providers.registry",
    "derive_seed": "queue_providers.seeding",
    "resolve": "queue_providers.registry",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'queue_providers' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
