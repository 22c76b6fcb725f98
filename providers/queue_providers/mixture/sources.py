"""A mixture's sources in a worker: each source provider and its meta, checked to give
batches of one schema. Their rows by position are rows.py's business.

Each source runs as worker 0 of 1, whatever the mixture's workers: a streaming source's own
stream is then one stream, the same in every worker (rows.py runs it whole in each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from queue_client.errors import ConfigError
from queue_client.format.batchfile import FORMAT_VERSION
from queue_client.format.meta import split_schema
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.mixture.rows import SourceRows
from queue_providers.registry import create
from queue_providers.seeding import derive_seed

__all__ = ["SourceRows", "build_sources", "check_same_schema", "source_meta"]

# Meta keys whose values must agree between sources: a trainer sizes its model by them.
SHARED_KEYS = ("training_type", "vocab_size", "block_size")


def build_sources(
    context: ProviderContext, sources: Sequence[Mapping[str, Any]]
) -> list[DataProviderBase]:
    """Each source's provider, with a seed of its own, as the only worker of its stream."""
    out = []
    for spec in sources:
        name = spec["name"]
        sub = replace(
            context,
            seed=derive_seed(context.seed, "mixture source", name),
            extra_meta={},
            histogram_field="",
            worker_index=0,
            num_workers=1,
        )
        out.append(create(spec["provider"], sub, dict(spec.get("args") or {})))
    return out


def source_meta(provider: DataProviderBase, context: ProviderContext) -> dict[str, Any]:
    """What a source's set_meta needs: its build_meta plus the keys the base fills in."""
    meta = dict(provider.build_meta())
    meta.update(
        dataset_name=context.dataset_name,
        batch_size=context.batch_size,
        batches_per_file=context.batches_per_file,
        batch_format_version=FORMAT_VERSION,
    )
    return meta


def check_same_schema(names: Sequence[str], metas: Sequence[Mapping[str, Any]], where: str) -> None:
    """Refuse sources whose batches differ: other splits, fields, or model-sizing keys."""
    first, base = names[0], metas[0]
    for name, meta in zip(names[1:], metas[1:], strict=True):
        if set(meta["split_info"]) != set(base["split_info"]):
            raise ConfigError(
                f"{where}: sources {first!r} and {name!r} have different splits: "
                f"{sorted(base['split_info'])} and {sorted(meta['split_info'])}"
            )
        keys = [k for k in SHARED_KEYS if base.get(k) != meta.get(k)]
        if keys:
            raise ConfigError(
                f"{where}: sources {first!r} and {name!r} differ in {keys}: "
                f"{[base.get(k) for k in keys]} and {[meta.get(k) for k in keys]}"
            )
        for split in base["split_info"]:
            a = {f.name: f.to_dict() for f in split_schema(base, split)}
            b = {f.name: f.to_dict() for f in split_schema(meta, split)}
            differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            if differ:
                raise ConfigError(
                    f"{where}: sources {first!r} and {name!r} have different batch schemas "
                    f"in split {split!r}: fields {differ} differ"
                )
