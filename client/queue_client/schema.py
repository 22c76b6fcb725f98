"""The batch schema: what each field of a batch is, and checks that a batch matches it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queue_client.errors import MetaError, SchemaMismatch

if TYPE_CHECKING:
    import torch

ROLES = ("", "input", "target", "mask")

# Names as torch spells them without "torch."; the server checks names without importing torch.
DTYPES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip


def check_dtype_name(name: str) -> str:
    if name not in DTYPES:
        raise MetaError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a schema dtype name such as "int64"."""
    import torch

    return getattr(torch, check_dtype_name(name))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FieldSpec:
    """One field of a batch: `shape` is one sample's shape, without the batch axis."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise MetaError(f"schema field name {self.name!r} must be an identifier")
        try:
            check_dtype_name(self.dtype)
        except MetaError as exc:
            raise MetaError(f"schema field {self.name!r}: {exc}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape):
            raise MetaError(
                f"schema field {self.name!r}: shape {self.shape!r} must be positive ints"
            )
        if self.role not in ROLES:
            raise MetaError(f"schema field {self.name!r}: role {self.role!r} not in {ROLES}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FieldSpec:
        missing = [k for k in ("name", "dtype", "shape") if k not in raw]
        if missing:
            raise MetaError(f"schema field {raw!r} lacks {missing}")
        return cls(
            name=raw["name"],
            dtype=raw["dtype"],
            shape=tuple(int(d) for d in raw["shape"]),
            role=raw.get("role", "") or "",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "role": self.role,
        }


def parse_schema(raw: Sequence[Mapping[str, Any]]) -> tuple[FieldSpec, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise MetaError(f"batch_schema must be a non-empty list of fields, got {raw!r}")
    fields = tuple(FieldSpec.from_dict(f) for f in raw)
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise MetaError(f"batch_schema repeats a field name: {names}")
    return fields


def is_xy(schema: Sequence[FieldSpec]) -> bool:
    """nanoGPT-style schemas, served as an (X, Y) tuple."""
    return [f.name for f in schema] == ["x", "y"]


def check_tensors(
    schema: Sequence[FieldSpec], tensors: Mapping[str, torch.Tensor], lead: tuple[int, ...]
) -> None:
    """Raise SchemaMismatch naming the first field whose name, dtype or shape is off.

    `lead` is the shape in front of each sample's shape: (batch_size,) for one batch,
    (num_batches, batch_size) for a whole file.
    """
    expected = {f.name for f in schema}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise SchemaMismatch(f"fields {extra} are not in the schema {sorted(expected)}")
    import torch

    for f in schema:
        if f.name not in tensors:
            raise SchemaMismatch(f"field {f.name!r} is missing from the batch")
        t = tensors[f.name]
        if not isinstance(t, torch.Tensor):
            raise SchemaMismatch(f"field {f.name!r} is a {type(t).__name__}, not a tensor")
        if dtype_name(t.dtype) != f.dtype:
            raise SchemaMismatch(
                f"field {f.name!r} has dtype {dtype_name(t.dtype)}, schema says {f.dtype}"
            )
        want = (*lead, *f.shape)
        if tuple(t.shape) != want:
            raise SchemaMismatch(f"field {f.name!r} has shape {tuple(t.shape)}, schema says {want}")
