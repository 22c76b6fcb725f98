"""The batch schema: what each field of a batch is, how it lies in a batch file, and checks
that a batch matches it.

A field is served as `dtype` and `shape`. How it is stored is its `Storage`: as itself
("plain", maybe in a narrower `stored_dtype`), as a slice of a token window it shares with
another field ("window": x = w[..., :-1], y = w[..., 1:]), or not at all, derived when it is
served (attention masks, segment ids, LM labels). storage.py turns stored tensors into served
ones and back; FORMAT.md describes each kind.
"""

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


def token_dtype_name(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every token id below vocab_size."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def signed_dtype_name(low: int, high: int) -> str:
    """The narrowest signed dtype holding every value in [low, high] (labels with -100)."""
    for name, bits in (("int8", 8), ("int16", 16), ("int32", 32)):
        if -(1 << (bits - 1)) <= low and high < 1 << (bits - 1):
            return name
    return "int64"


def unsigned_dtype_name(high: int) -> str:
    """The narrowest unsigned dtype holding every value in [0, high] (class ids)."""
    for name, bits in (("uint8", 8), ("uint16", 16), ("uint32", 32)):
        if high < 1 << bits:
            return name
    return "int64"


# How a field lies in a batch file. Direct kinds read the field's values from a stored tensor;
# derived kinds store nothing and compute the field from other served fields when it is served.
PLAIN = "plain"  # the stored tensor `source` (default: the field's own name), as stored_dtype
WINDOW = "window"  # source[..., offset : offset + n] of a token window shared by several fields
NEXT_TOKEN = "next_token"  # a window slice, `ignore` where the document of field `ids` ends
NOT_EQUAL = "not_equal"  # field `source` != value (attention masks from a pad id)
AFTER_FIRST = "after_first"  # after the first `value` in field `source`, and not `pad`
SEGMENTS = "segments"  # documents of field `ids` numbered from 1 in each row, 0 on padding
LENGTH_MASK = "length_mask"  # True before the row's length in stored `lengths`
DIRECT_KINDS = (PLAIN, WINDOW, NEXT_TOKEN)
DERIVED_KINDS = (NOT_EQUAL, AFTER_FIRST, SEGMENTS, LENGTH_MASK)
KINDS = DIRECT_KINDS + DERIVED_KINDS
# Kinds whose document ends are the positions of the end-of-document id `value` in field
# `ids`, less those listed in the stored tensor `exceptions`, before the row's stored length.
DOCUMENT_KINDS = (NEXT_TOKEN, SEGMENTS, LENGTH_MASK)


@dataclass(frozen=True)
class Storage:
    """How one field lies in a batch file; the default is the field itself, as served."""

    kind: str = PLAIN
    source: str = ""
    offset: int = 0
    value: int = 0
    pad: int = 0
    ignore: int = -100
    ids: str = ""
    lengths: str = ""
    exceptions: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], field_name: str) -> Storage:
        if not isinstance(raw, Mapping):
            raise MetaError(f"schema field {field_name!r}: storage must be a table, got {raw!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise MetaError(
                f"schema field {field_name!r}: storage has unknown key(s) {unknown}; "
                f"expected some of {sorted(known)}"
            )
        try:
            return cls(**dict(raw))
        except TypeError as exc:
            raise MetaError(f"schema field {field_name!r}: storage {dict(raw)!r}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Only the keys that differ from the defaults."""
        default = Storage()
        return {
            k: getattr(self, k)
            for k in self.__dataclass_fields__
            if k == "kind" or getattr(self, k) != getattr(default, k)
        }

    @property
    def direct(self) -> bool:
        return self.kind in DIRECT_KINDS


@dataclass(frozen=True)
class FieldSpec:
    """One field of a batch: `shape` is one sample's shape, without the batch axis."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str = ""
    # The dtype of the stored tensor a direct field is read from ("": dtype itself); derived
    # fields store nothing and leave it empty.
    stored_dtype: str = ""
    storage: Storage = Storage()

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
        self._check_storage()

    def _check_storage(self) -> None:
        where = f"schema field {self.name!r}"
        st = self.storage
        if not isinstance(st, Storage):
            raise MetaError(f"{where}: storage must be a Storage, got {st!r}")
        if st.kind not in KINDS:
            raise MetaError(
                f"{where}: storage kind {st.kind!r} is unknown to this batchqueue (it knows "
                f"{list(KINDS)}); upgrade batchqueue"
            )
        for key in ("source", "ids", "lengths", "exceptions"):
            value = getattr(st, key)
            if not isinstance(value, str) or (value and not value.isidentifier()):
                raise MetaError(f"{where}: storage {key} {value!r} must be an identifier")
        for key in ("offset", "value", "pad", "ignore"):
            value = getattr(st, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise MetaError(f"{where}: storage {key} {value!r} must be an int")
        if st.offset < 0:
            raise MetaError(f"{where}: storage offset {st.offset} must be >= 0")
        if st.direct:
            if self.stored_dtype:
                try:
                    check_dtype_name(self.stored_dtype)
                except MetaError as exc:
                    raise MetaError(f"{where}: stored_dtype: {exc}") from None
        elif self.stored_dtype:
            raise MetaError(
                f"{where}: a {st.kind} field is derived, nothing is stored for it, so it has "
                f"no stored_dtype (got {self.stored_dtype!r})"
            )
        if st.kind in (WINDOW, NEXT_TOKEN, NOT_EQUAL, AFTER_FIRST) and not st.source:
            raise MetaError(f"{where}: storage kind {st.kind} needs a source")
        if st.kind in (WINDOW, NEXT_TOKEN) and not self.shape:
            raise MetaError(f"{where}: a {st.kind} field needs at least one dimension")
        if st.kind in (NEXT_TOKEN, SEGMENTS) and not st.ids:
            raise MetaError(f"{where}: storage kind {st.kind} needs ids, the field of token ids")

    @property
    def stored_as(self) -> str:
        """The dtype this field's values are stored in; "" for a derived field."""
        if not self.storage.direct:
            return ""
        return self.stored_dtype or self.dtype

    @property
    def stored_name(self) -> str:
        """The stored tensor a direct field reads from; "" for a derived field."""
        if not self.storage.direct:
            return ""
        return self.storage.source or self.name

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FieldSpec:
        missing = [k for k in ("name", "dtype", "shape") if k not in raw]
        if missing:
            raise MetaError(f"schema field {raw!r} lacks {missing}")
        storage = raw.get("storage")
        return cls(
            name=raw["name"],
            dtype=raw["dtype"],
            shape=tuple(int(d) for d in raw["shape"]),
            role=raw.get("role", "") or "",
            stored_dtype=raw.get("stored_dtype", "") or "",
            storage=Storage() if storage is None else Storage.from_dict(storage, str(raw["name"])),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data; a field stored as itself writes no storage keys, as before they existed."""
        out: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "role": self.role,
        }
        if self.stored_dtype:
            out["stored_dtype"] = self.stored_dtype
        if self.storage != Storage():
            out["storage"] = self.storage.to_dict()
        return out


def parse_schema(raw: Sequence[Mapping[str, Any]]) -> tuple[FieldSpec, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise MetaError(f"batch_schema must be a non-empty list of fields, got {raw!r}")
    fields = tuple(FieldSpec.from_dict(f) for f in raw)
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise MetaError(f"batch_schema repeats a field name: {names}")
    check_storage(fields)
    return fields


def check_storage(fields: Sequence[FieldSpec]) -> None:
    """The fields' storage fits together: a derived field reads a direct field; fields that
    share a stored tensor agree on its dtype and leading shape; no stored tensor is named
    like a field it does not hold."""
    by_name = {f.name: f for f in fields}
    stored: dict[str, FieldSpec] = {}
    for f in fields:
        st = f.storage
        where = f"schema field {f.name!r}"
        for key in ("source", "ids") if not st.direct else ("ids",):
            ref = getattr(st, key)
            if not ref:
                continue
            target = by_name.get(ref)
            if target is None or not target.storage.direct or target is f:
                raise MetaError(
                    f"{where}: storage {key} {ref!r} must name another field that is stored "
                    f"(fields: {sorted(by_name)})"
                )
        if st.kind == NEXT_TOKEN and by_name[st.ids].shape != f.shape:
            raise MetaError(f"{where}: its ids field {st.ids!r} has another shape")
        if (
            not st.direct
            and st.kind != LENGTH_MASK
            and by_name[st.source or st.ids].shape != f.shape
        ):
            raise MetaError(f"{where}: it is derived from a field of another shape")
        name = f.stored_name
        if name:
            other = stored.setdefault(name, f)
            if other.stored_as != f.stored_as or other.shape[:-1] != f.shape[:-1]:
                raise MetaError(
                    f"{where} and {other.name!r} share stored tensor {name!r} but not its "
                    "dtype and leading shape"
                )
            if other.storage.kind == PLAIN and other is not f:
                raise MetaError(f"{where}: stored tensor {name!r} is field {other.name!r}'s own")
            if f.storage.kind == PLAIN and other is not f:
                raise MetaError(f"{where}: stored tensor {name!r} is shared by {other.name!r}")
    aux = {n for f in fields for n in (f.storage.lengths, f.storage.exceptions) if n}
    clash = sorted(aux & (set(stored) | set(by_name)))
    if clash:
        raise MetaError(f"stored tensor(s) {clash} of lengths or exceptions clash with a field")
    for f in fields:
        if f.stored_name in by_name and by_name[f.stored_name] is not f:
            raise MetaError(
                f"schema field {f.name!r}: its stored tensor {f.stored_name!r} is named like a field"
            )


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
