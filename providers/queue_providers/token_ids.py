"""The write-time check that no served id is out of range: an id >= vocab_size crashes (or,
worse, silently wraps in) a trainer's embedding lookup, far from the provider that made it.

Which fields hold ids follows from the schema and the training type: integer fields with role
"input" are token ids (< vocab_size); integer "target" fields are token ids for LM and MLM,
class ids for CLASSIFICATION (< num_classes) and tag ids for TOKEN_CLASSIFICATION
(< num_labels). A target may also hold the ignore index (meta["ignore_index"], -100 by
default), which losses skip. The check is two reductions per field per file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queue_client.errors import SchemaMismatch
from queue_client.format.schema import FieldSpec

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
_INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
# The meta key that bounds a target field's ids, by training type.
_TARGET_BOUND = {
    "LM": "vocab_size",
    "MLM": "vocab_size",
    "CLASSIFICATION": "num_classes",
    "TOKEN_CLASSIFICATION": "num_labels",
}


@dataclass(frozen=True)
class IdRange:
    """Field `field` must hold ids in [0, stop), or `ignore` where not None."""

    field: str
    bound_key: str  # the meta key stop comes from, for the error message
    stop: int
    ignore: int | None = None


def id_ranges(meta: Mapping[str, Any], schema: Sequence[FieldSpec]) -> tuple[IdRange, ...]:
    """The id fields of one split's schema and the range each must stay in."""
    ranges = []
    ignore = meta.get("ignore_index", IGNORE_INDEX)
    for spec in schema:
        if spec.dtype not in _INTEGER_DTYPES:
            continue
        if spec.role == "input":
            key = "vocab_size"
        elif spec.role == "target":
            key = _TARGET_BOUND.get(str(meta.get("training_type")), "")
        else:
            continue
        stop = meta.get(key) if key else None
        if isinstance(stop, int) and not isinstance(stop, bool):
            ranges.append(IdRange(spec.name, key, stop, ignore if spec.role == "target" else None))
    return tuple(ranges)


def check_ids(
    tensors: Mapping[str, torch.Tensor], ranges: Sequence[IdRange], *, where: str
) -> None:
    """Raise SchemaMismatch naming the field, the id found and the bound, if any id of a
    range's field lies outside it."""
    import torch

    for r in ranges:
        values = tensors[r.field]
        if values.numel() == 0:
            continue
        if values.dtype not in (torch.int32, torch.int64):
            values = values.to(torch.int64)  # aminmax lacks some small and unsigned dtypes
        if r.ignore is not None:
            values = values.masked_fill(values == r.ignore, 0)
        low, high = (int(v) for v in torch.aminmax(values))
        if high >= r.stop or low < 0:
            bad = high if high >= r.stop else low
            allowed = f"[0, {r.stop})" + ("" if r.ignore is None else f" or {r.ignore}")
            raise SchemaMismatch(
                f"{where}: field {r.field!r} holds id {bad} (max {high}, min {low}) but "
                f"{r.bound_key} is {r.stop}: ids must lie in {allowed}. The provider made an "
                "id its meta does not allow; this file is not published"
            )
