"""A provider from a worker's init request: the same for a worker process (worker_main.py)
and a Ray actor (ray_actor.py), so both make the same provider, and so the same bytes, from
the inputs the dataset was built from (check_own_inputs)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from queue_providers import DataProviderBase, ProviderContext, create
from queue_providers.inputs import check_inputs


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


def check_own_inputs(provider: DataProviderBase, init: Mapping[str, Any]) -> None:
    """ConfigError naming the input when what this provider listed (an object's version at a
    URL, a file's size and sha256) is not what the dataset was built from: init["inputs"]
    holds inputs.json's records and meta's fingerprint once meta exists. A worker started or
    restarted after an object was rewritten would otherwise list the new version, and read
    it whole, while inputs.json records the old one."""
    built = init.get("inputs")
    if built:
        check_inputs(
            provider.input_files(), built["records"], built["fingerprint"], dataset=init["dataset"]
        )


def set_weight_changes(provider: DataProviderBase, split: str, changes: Any) -> None:
    """A mixture's journaled SetMixture calls, sent with each produce; others have none."""
    if hasattr(provider, "set_weight_changes"):
        provider.set_weight_changes(split, changes or ())


def one_torch_thread() -> None:
    """One torch thread in a worker or actor, once torch is imported (by the preload, or by
    a provider): parallelism comes from worker processes, and more threads would fight the
    trainer for the same cores. A provider that makes files without torch (char_lm) never
    imports it, so this is looked for around each request, not done at the start."""
    global _torch_threads_set
    torch = None if _torch_threads_set else sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
        _torch_threads_set = True


_torch_threads_set = False
