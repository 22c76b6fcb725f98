"""Whether the workers' forkserver preloads torch, decided from the config's provider names
before anything else of the server is imported.

torch is most of a worker's start (a second or more of CPU) and of its memory. Preloaded in
the forkserver, every worker shares it; a provider that makes its files without it (char_lm)
is better off with none at all (char_lm and nanogpt_bin draw their windows with numpy). So the forkserver preloads torch unless every dataset's
provider is one of TORCH_FREE_PROVIDERS. A config this cannot read, or one naming any other
provider (a class of the operator's own among them), gets torch: a wrong guess costs time and
memory, never correctness (a worker imports what its provider needs), and the config's own
errors are reported where the config is parsed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from queue_server.config import DEFAULT_CONFIG

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "TORCH_FREE_PROVIDERS",
    "config_needs_torch",
    "providers_need_torch",
    "tables_need_torch",
]

# Built-in providers whose workers make files without importing torch. A curriculum split's
# composer imports torch in its own process either way.
TORCH_FREE_PROVIDERS = frozenset({"char_lm", "nanogpt_bin"})


def providers_need_torch(providers: Iterable[object]) -> bool:
    """False only for some providers, each of them torch-free."""
    names = list(providers)
    return not names or any(name not in TORCH_FREE_PROVIDERS for name in names)


def tables_need_torch(tables: Mapping[str, Any]) -> bool:
    """providers_need_torch of a config's tables ({"datasets": {NAME: {"provider": ...}}})."""
    datasets = tables.get("datasets")
    if not isinstance(datasets, Mapping):
        return True
    return providers_need_torch(
        table.get("provider") if isinstance(table, Mapping) else None for table in datasets.values()
    )


def config_needs_torch(path: Path | None) -> bool:
    """tables_need_torch of a TOML config file (the embedded default when None)."""
    try:
        text = Path(path if path is not None else DEFAULT_CONFIG).read_text(encoding="utf-8")
        return tables_need_torch(tomllib.loads(text))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True
