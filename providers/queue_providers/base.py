"""DataProviderBase: the one class a dataset subclasses to be served by batchqueue.

A subclass overrides `build_meta` and `sample_batch`; the base owns everything else: strict meta
validation, the per-file RNG, stacking batches into a file and publishing it atomically. The
server runs providers in worker processes and decides *which* seq each worker produces next, so
backpressure and ordering live in the server, not here.

Determinism: a file's content is a pure function of (config, seed, split, seq) for stateless
providers, since the RNG is seeded from exactly those. A provider that streams (reads documents
in order) also overrides `state_dict`/`load_state_dict`; the server journals the state before
each file so any seq can be produced again.
"""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from queue_client.batchfile import PublishedFile, write_batch_file
from queue_client.errors import MetaError
from queue_client.meta import split_schema, validate_meta
from queue_client.schema import FieldSpec, check_tensors


@dataclass(frozen=True)
class ProviderContext:
    """What the server tells a provider about where and as whom it runs."""

    dataset_name: str
    dataset_dir: Path
    batch_size: int
    batches_per_file: int = 100
    seed: int = 1337
    # This process's place among the split's workers: a streaming provider reads only the
    # documents of shard worker_index of num_workers, so no two workers see the same document.
    worker_index: int = 0
    num_workers: int = 1
    verbose: bool = False
    # Provider-independent facts recorded into meta (the config fingerprint, the provider name).
    extra_meta: Mapping[str, Any] = field(default_factory=dict)


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from (seed, parts...), stable across processes and Python versions."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DataProviderBase(abc.ABC):
    """Base of every provider. Subclasses take their config args as keyword-only parameters."""

    def __init__(self, context: ProviderContext) -> None:
        self.context = context
        self._schemas: dict[str, tuple[FieldSpec, ...]] = {}

    # ---- what a dataset overrides -------------------------------------------------------
    @abc.abstractmethod
    def build_meta(self) -> dict[str, Any]:
        """The dataset's meta: training_type, batch_schema, split_info and the keys the
        training type needs (vocab_size, block_size, ...). dataset_name and batch_size are
        filled in by the base."""

    @abc.abstractmethod
    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """One batch: a tensor per schema field, shaped [batch_size, *field.shape]."""

    def state_dict(self, split: str) -> dict[str, Any]:
        """JSON-serialisable stream state of `split` (empty for stateless providers)."""
        return {}

    def load_state_dict(self, split: str, state: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict`, to produce a journaled seq again."""
        if state:
            raise ValueError(
                f"{type(self).__name__} is stateless but was given state {dict(state)!r}"
            )

    # ---- provided --------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.context.batch_size

    def complete_meta(self) -> dict[str, Any]:
        """build_meta() plus the keys the base owns, validated strictly."""
        meta = dict(self.build_meta())
        for key, value in (
            ("dataset_name", self.context.dataset_name),
            ("batch_size", self.batch_size),
        ):
            if key in meta and meta[key] != value:
                raise MetaError(
                    f"build_meta() set {key}={meta[key]!r} but the config says {value!r}"
                )
            meta[key] = value
        meta["batches_per_file"] = self.context.batches_per_file
        meta.update(self.context.extra_meta)
        validate_meta(meta, where=f"{type(self).__name__}.build_meta()")
        return meta

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        """Learn the split schemas from the meta the server settled on."""
        self._schemas = {split: split_schema(meta, split) for split in meta["split_info"]}

    def file_rng(self, split: str, seq: int) -> torch.Generator:
        """The RNG for one file: seeded from (seed, split, seq) alone."""
        return torch.Generator().manual_seed(derive_seed(self.context.seed, split, seq))

    def produce_file(self, split: str, seq: int, directory: Path) -> PublishedFile:
        """Sample batches_per_file batches, check them against the schema, publish the file."""
        schema = self._schemas.get(split)
        if schema is None:
            raise MetaError(f"split {split!r} is not in meta split_info {sorted(self._schemas)}")
        rng = self.file_rng(split, seq)
        batches = [self.sample_batch(split, rng) for _ in range(self.context.batches_per_file)]
        for b in batches:
            check_tensors(schema, b, (self.batch_size,))
        tensors = {f.name: torch.stack([b[f.name] for b in batches]) for f in schema}
        metadata = {
            "dataset": self.context.dataset_name,
            "split": split,
            "batch_size": self.batch_size,
            "produced_at_ms": int(time.time() * 1000),
            "schema": [f.to_dict() for f in schema],
        }
        return write_batch_file(Path(directory), seq=seq, tensors=tensors, metadata=metadata)

    def on_start(self) -> None:
        """Called once in the worker process before the first file."""

    def on_stop(self) -> None:
        """Called once when the worker process shuts down cleanly."""
