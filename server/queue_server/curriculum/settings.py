"""A curriculum split's settings, as the server derives them from config and meta and the
composer process receives them (as JSON). No numpy here: the server imports it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from queue_client import errors
from queue_client.format.meta import split_schema
from queue_server.config.server import DatasetConfig
from queue_server.curriculum.schedule import AlphaSchedule


@dataclass(frozen=True)
class ComposerSettings:
    vocab_size: int
    batches_per_file: int  # K: batches per served file
    candidate_batches_per_file: int
    capacity: int  # candidate batches kept in the buffer
    oversample: float  # candidate batches ingested per served batch
    schedule: AlphaSchedule = field(default_factory=AlphaSchedule)
    # Composer processes sharing the buffer (shards.py); what is served does not depend on it.
    composers: int = 1
    # Independent streams (streams.py): stream k composes the served seqs = k (mod streams).
    streams: int = 1

    @property
    def files_per_plan(self) -> int:
        """Candidate files ingested per served file: at least K batches, oversample times."""
        return max(
            1, math.ceil(self.oversample * self.batches_per_file / self.candidate_batches_per_file)
        )

    @property
    def initial_files(self) -> int:
        return math.ceil(self.capacity / self.candidate_batches_per_file)

    @property
    def max_age(self) -> int:
        """Served files a candidate may wait before it is culled: two turns of the buffer.
        This is what lets every candidate file retire, so the disk stays bounded."""
        per_plan = self.files_per_plan * self.candidate_batches_per_file
        return math.ceil(2 * self.capacity / per_plan) + 1

    @property
    def candidate_backlog(self) -> int:
        """Candidate files allowed ahead of the oldest one the buffer still holds: the
        buffer's widest span (the first fill, then max_age files' worth of ingests) plus the
        next file's ingest, made ahead of need."""
        return self.initial_files + self.files_per_plan * (self.max_age + 2)

    def to_json(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "batches_per_file": self.batches_per_file,
            "candidate_batches_per_file": self.candidate_batches_per_file,
            "capacity": self.capacity,
            "oversample": self.oversample,
            "schedule": self.schedule.to_json(),
            "composers": self.composers,
            "streams": self.streams,
        }

    @classmethod
    def from_json(cls, raw: Mapping) -> ComposerSettings:
        return cls(
            int(raw["vocab_size"]),
            int(raw["batches_per_file"]),
            int(raw["candidate_batches_per_file"]),
            int(raw["capacity"]),
            float(raw["oversample"]),
            AlphaSchedule.from_json(raw["schedule"]),
            int(raw.get("composers", 1)),
            int(raw.get("streams", 1)),
        )


def curriculum_settings(
    config: DatasetConfig, meta: dict[str, Any], split: str
) -> tuple[ComposerSettings, str]:
    """The composer's settings for one split, and the field it scores; errors name the key."""
    where = f"datasets.{config.name}"
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise errors.ConfigError(
            f'{where}.selection = "curriculum" needs a vocab_size in meta; provider '
            f"{config.provider!r} declares {vocab_size!r}"
        )
    schema = {f.name: f for f in split_schema(meta, split)}
    field_name = config.curriculum.field or meta.get("token_field") or ""
    if not field_name:
        field_name = next((n for n in ("x", "input_ids") if n in schema), "")
    spec = schema.get(field_name)
    if spec is None:
        raise errors.ConfigError(
            f"{where}.curriculum_field = {field_name!r} is not a field of split {split!r}; "
            f"its fields are {sorted(schema)}"
        )
    if not spec.dtype.startswith(("int", "uint")):
        raise errors.ConfigError(
            f"{where}.curriculum_field = {field_name!r} holds {spec.dtype}, not token ids"
        )
    schedule = AlphaSchedule(
        float(config.curriculum.alpha),
        tuple((float(x), float(a)) for x, a in config.curriculum.schedule),
        config.curriculum.schedule_unit,
    )
    settings = ComposerSettings(
        vocab_size=vocab_size,
        batches_per_file=config.batches_per_file,
        candidate_batches_per_file=config.batches_per_file,
        capacity=max(config.curriculum.candidate_buffer, config.batches_per_file),
        oversample=float(config.curriculum.candidate_oversample),
        schedule=schedule,
        composers=config.curriculum.composer_workers,
        streams=config.curriculum.streams,
    )
    return settings, field_name
