"""A provider from a worker's init request: the same for a worker process (worker_main.py)
and a Ray actor (ray_actor.py), so both make the same provider, and so the same bytes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from queue_providers import DataProviderBase, ProviderContext, create


def provider_context(init: Mapping[str, Any]) -> ProviderContext:
    """The context of an init request (data_root, dataset, batch_size, seed, ...)."""
    root = Path(init["data_root"])
    return ProviderContext(
        dataset_name=init["dataset"],
        dataset_dir=root / init["dataset"],
        batch_size=init["batch_size"],
        batches_per_file=init["batches_per_file"],
        seed=init["seed"],
        worker_index=init.get("worker_index", 0),
        num_workers=init.get("num_workers", 1),
        verbose=init.get("verbose", False),
        extra_meta=init.get("extra_meta", {}),
        histogram_field=init.get("histogram_field", ""),
    )


def build_provider(init: Mapping[str, Any]) -> DataProviderBase:
    """The provider an init request names, with its args."""
    return create(init["provider"], provider_context(init), init.get("args", {}))


def set_weight_changes(provider: DataProviderBase, split: str, changes: Any) -> None:
    """A mixture's journaled SetMixture calls, sent with each produce; others have none."""
    if hasattr(provider, "set_weight_changes"):
        provider.set_weight_changes(split, changes or ())
