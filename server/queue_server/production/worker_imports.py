"""Whether the workers' forkserver preloads torch, decided from the config's datasets
before anything else of the server is imported.

torch is most of a worker's start (a second or more of CPU) and of its memory. Preloaded in
the forkserver, every worker shares it; a provider that makes its files without it is better
off with none at all: char_lm, nanogpt_bin and token_shards in window order draw and gather
their windows with numpy, and a mixture of such sources copies their stored rows. So the
forkserver preloads torch unless every dataset is one of TORCH_FREE_PROVIDERS with args that
keep it so, or a mixture of those alone. A config this cannot read, or one naming any
other provider (a class of the operator's own among them), gets torch: a wrong guess costs
time and memory, never correctness (a worker imports what its provider needs), and the
config's own errors are reported where the config is parsed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
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
    "datasets_need_torch",
    "tables_need_torch",
]

# Built-in providers whose workers make files without importing torch, and for each the args
# under which it does not (token_shards' document order encodes through torch). A curriculum
# split's composer imports torch in its own process either way.
TORCH_FREE_PROVIDERS: dict[str, dict[str, object]] = {
    "char_lm": {},
    "nanogpt_bin": {},
    "token_shards": {"order": "windows"},
}


def datasets_need_torch(datasets: Iterable[tuple[object, object]]) -> bool:
    """False only for some datasets, (provider, args) each, all of them torch-free: a
    provider of TORCH_FREE_PROVIDERS whose args are as its entry there says (or unset)."""
    pairs = list(datasets)
    return not pairs or any(_needs_torch(provider, args) for provider, args in pairs)


def _needs_torch(provider: object, args: object) -> bool:
    if provider == "mixture":
        return _mixture_needs_torch(args)
    free_when = TORCH_FREE_PROVIDERS.get(provider) if isinstance(provider, str) else None
    if free_when is None or not isinstance(args, Mapping | None):
        return True
    given = args or {}
    return any(given.get(key, value) != value for key, value in free_when.items())


def _mixture_needs_torch(args: object) -> bool:
    """A mixture copies its sources' stored rows without torch where every source is
    torch-free (its files are then made as the sources make theirs)."""
    sources = args.get("sources") if isinstance(args, Mapping) else None
    if not isinstance(sources, Sequence) or isinstance(sources, str) or not sources:
        return True
    return datasets_need_torch(
        (s.get("provider"), s.get("args")) if isinstance(s, Mapping) else (None, None)
        for s in sources
    )


def tables_need_torch(tables: Mapping[str, Any]) -> bool:
    """datasets_need_torch of a config's tables ({"datasets": {NAME: {"provider": ...,
    "args": {...}}}})."""
    datasets = tables.get("datasets")
    if not isinstance(datasets, Mapping):
        return True
    return datasets_need_torch(_provider_and_args(table) for table in datasets.values())


def _provider_and_args(table: object) -> tuple[object, object]:
    """A dataset table's provider and args as the parsed config has them: a table of
    `sources` is the mixture provider's, its source tables a list in its args."""
    if not isinstance(table, Mapping):
        return None, None
    sources = table.get("sources")
    if sources is None:
        return table.get("provider"), table.get("args")
    if "provider" in table or not isinstance(sources, Mapping):
        return None, None  # the config's error, reported where it is parsed
    return "mixture", {"sources": list(sources.values())}


def config_needs_torch(path: Path | None) -> bool:
    """tables_need_torch of a TOML config file (the embedded default when None)."""
    try:
        text = Path(path if path is not None else DEFAULT_CONFIG).read_text(encoding="utf-8")
        return tables_need_torch(tomllib.loads(text))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True
