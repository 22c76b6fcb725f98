"""A mixture's sources in a worker: each source provider, its meta, and its rows by position.

Row p of a source is row p % R of the source provider's own file p // R (R rows per file),
so a source's rows in the mixture are exactly its own stream, whatever the weights: nothing
skipped, nothing repeated. Only providers whose files are a pure function of their seq can be
sources; a streaming provider (its files depend on the stream before them) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from queue_client.batchfile import FORMAT_VERSION, load_batch_bytes
from queue_client.errors import ConfigError
from queue_client.meta import split_schema
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.registry import create
from queue_providers.seeding import derive_seed

# Meta keys whose values must agree between sources: a trainer sizes its model by them.
SHARED_KEYS = ("training_type", "vocab_size", "block_size")


def build_sources(
    context: ProviderContext, sources: Sequence[Mapping[str, Any]]
) -> list[DataProviderBase]:
    """Each source's provider, with a seed of its own; streaming providers refused."""
    out = []
    for spec in sources:
        name = spec["name"]
        sub = replace(
            context,
            seed=derive_seed(context.seed, "mixture source", name),
            extra_meta={},
            histogram_field="",
        )
        provider = create(spec["provider"], sub, dict(spec.get("args") or {}))
        if type(provider).state_dict is not DataProviderBase.state_dict:
            raise ConfigError(
                f"datasets.{context.dataset_name}.sources.{name}: provider "
                f"{spec['provider']!r} streams (each file depends on the stream before it), "
                "so a mixture cannot make a source row from its position alone; use a provider "
                "whose files are a pure function of their seq (char_lm, nanogpt_bin, "
                "token_shards) as a source, or serve it as a dataset of its own"
            )
        out.append(provider)
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


class SourceRows:
    """One source's served rows by position in its own stream, the last file made cached."""

    def __init__(self, provider: DataProviderBase) -> None:
        self.provider = provider
        self._cached: tuple[str, int, dict[str, torch.Tensor]] | None = None

    def _file(self, split: str, seq: int) -> dict[str, torch.Tensor]:
        """Every served field of the source's file `seq`, as [rows, ...]."""
        if self._cached is not None and self._cached[:2] == (split, seq):
            return self._cached[2]
        encoded = self.provider.make_file(split, seq)
        served = load_batch_bytes(encoded.data, f"source file {seq}").tensors
        rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in served.items()}
        self._cached = (split, seq, rows)
        return rows

    def rows(self, split: str, start: int, stop: int, per_file: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) of the source's stream."""
        parts: list[dict[str, torch.Tensor]] = []
        p = start
        while p < stop:
            seq, offset = divmod(p, per_file)
            take = min(stop - p, per_file - offset)
            file_rows = self._file(split, seq)
            parts.append({k: v[offset : offset + take] for k, v in file_rows.items()})
            p += take
        if not parts:
            return {}
        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
