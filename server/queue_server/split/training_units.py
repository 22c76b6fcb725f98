"""A split's files in training terms: tokens and samples per file, and its epoch size.

Why: operators think in tokens/s and epochs, the queue in files. The numbers come from meta
alone (no file is read): a sample's tokens are the positions of its token field (meta's
token_field, else "x", else "input_ids", else the first input field), padding included; an
epoch is the split's size in meta's split_info: "tokens", else "examples" or "sentences".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from queue_client.errors import MetaError
from queue_client.format.meta import token_field

# split_info keys that give a split's size, in the order they are looked for, with the unit.
EPOCH_KEYS = (("tokens", "tokens"), ("examples", "samples"), ("sentences", "samples"))


@dataclass(frozen=True)
class SplitUnits:
    batches_per_file: int
    samples_per_file: int
    tokens_per_file: int
    # The split's size in `epoch_unit` ("tokens" or "samples"); None when meta gives none.
    epoch_size: int | None = None
    epoch_unit: str = ""

    def per_file(self) -> int:
        """Epoch units (tokens or samples) in one file."""
        return self.tokens_per_file if self.epoch_unit == "tokens" else self.samples_per_file


def split_units(
    meta: Mapping[str, Any], split: str, batch_size: int, batches_per_file: int
) -> SplitUnits:
    """The split's units; a meta without a usable schema gives zeros rather than failing
    the stats it feeds."""
    try:
        _, tokens_per_sample = token_field(meta, split)
    except (MetaError, KeyError, IndexError, TypeError):
        tokens_per_sample = 0
    samples = batch_size * batches_per_file
    info = (
        meta.get("split_info", {}).get(split) if isinstance(meta.get("split_info"), dict) else None
    )
    size, unit = None, ""
    if isinstance(info, Mapping):
        for key, key_unit in EPOCH_KEYS:
            value = info.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                size, unit = value, key_unit
                break
    if unit == "tokens" and tokens_per_sample == 0:
        size, unit = None, ""
    return SplitUnits(batches_per_file, samples, samples * tokens_per_sample, size, unit)
