"""Batch file format version 3: a fixed prefix, a JSON header, aligned raw tensor bytes.

    [magic 8][version u32][reserved u32 = 0][header length u64][JSON header][zero padding]
    [data: each tensor's bytes at a 64-byte aligned offset, zero padding between]

All integers and tensor bytes are little-endian. The header is JSON (sorted keys, no spaces,
ASCII) holding the metadata and one table entry per tensor; the data starts at the first
multiple of ALIGN past the header. FORMAT.md describes it byte by byte.

Loading is parsing: no unpickler, nothing in a file can run code, and the tensors are views
of one buffer (the file's copy-on-write map, or one copy of fetched bytes). `parse` checks
every field of the header against the size of the buffer, so a malformed file raises
CorruptBatchFile (naming the file and the fault) before any view is made.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.errors import CorruptBatchFile
from queue_client.format.schema import DTYPES

if TYPE_CHECKING:
    import torch

VERSION = 3
MAGIC = b"BQBATCH\x00"
# magic, version, reserved (0), header length: 24 bytes, little-endian.
PREFIX = struct.Struct("<8sIIQ")
# Tensor data offsets are multiples of this, so each view is aligned for any dtype (and SIMD).
ALIGN = 64
TABLES = ("tensors", "extras")
HEADER_KEYS = frozenset({"metadata", "tensors", "extras", "data_bytes"})
ENTRY_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "bfloat16": 2, "float16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "float64": 8,
}  # fmt: skip
assert set(ITEMSIZE) == set(DTYPES)
# The dtypes numpy holds as they are (all but bfloat16).
NUMPY_DTYPES = frozenset(ITEMSIZE) - {"bfloat16"}


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plain_json(value: Any, where: str) -> Any:
    """`value` as JSON data (tuples as lists), or ValueError naming the first part JSON cannot
    hold as it is: a non-str key, a NaN, a numpy scalar, a tensor, bytes..."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}: batch file metadata holds finite numbers")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(
                    f"{where} has key {k!r} ({type(k).__name__}): batch file metadata keys "
                    "are strings"
                )
            out[k] = plain_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__} ({value!r:.80}): "
        "batch file metadata is JSON data (dict with str keys, list, str, int, float, bool, "
        "None)"
    )


def encode(
    metadata: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    extras: Mapping[str, torch.Tensor | np.ndarray],
) -> bytes:
    """The bytes of a version 3 file; the same arguments give the same bytes anywhere.

    Tensors may be torch tensors or numpy arrays (a writer that never imports torch): the
    same values in the same dtype and shape make the same bytes."""
    if sys.byteorder != "little":
        raise ValueError("batch files are little-endian; this machine is big-endian")
    header: dict[str, Any] = {"metadata": plain_json(metadata, "metadata")}
    blobs: list[Any] = []
    pos = 0
    for table, mapping in (("tensors", tensors), ("extras", extras)):
        entries = []
        for name, t in mapping.items():
            if not isinstance(name, str):
                raise ValueError(f"{table} entry {name!r} is not a tensor under a str name")
            dtype, flat = _dtype_and_bytes(table, name, t)
            pos = _aligned(pos)
            entries.append(
                {
                    "name": name,
                    "dtype": dtype,
                    "shape": [int(n) for n in t.shape],
                    "offset": pos,
                    "nbytes": flat.nbytes,
                }
            )
            blobs.append((pos, flat))
            pos += flat.nbytes
        header[table] = entries
    header["data_bytes"] = pos
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    start = _aligned(PREFIX.size + len(text))
    parts: list[Any] = [PREFIX.pack(MAGIC, VERSION, 0, len(text)), text]
    at = PREFIX.size + len(text)
    for offset, flat in blobs:
        parts.append(bytes(start + offset - at))
        parts.append(flat.data)
        at = start + offset + flat.nbytes
    parts.append(bytes(start + pos - at))
    return b"".join(parts)


def _dtype_and_bytes(table: str, name: str, t: object) -> tuple[str, np.ndarray]:
    """A tensor's dtype name and its bytes in C order, as a flat uint8 array."""
    if isinstance(t, np.ndarray):
        dtype, array = t.dtype.name, t
    else:
        torch = sys.modules.get("torch")  # a torch tensor means torch is imported
        if torch is None or not isinstance(t, torch.Tensor):
            raise ValueError(f"{table} entry {name!r} is not a tensor under a str name")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype in ITEMSIZE:  # its bytes as uint8: numpy may lack the dtype (bfloat16)
            array = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if dtype not in ITEMSIZE:
        raise ValueError(f"{table} tensor {name!r} has dtype {dtype}, not one of {DTYPES}")
    return dtype, np.ascontiguousarray(array).reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the data
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """A parsed version 3 file: its metadata and where each tensor lies in the data."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[Entry, ...]
    extras: tuple[Entry, ...]
    data_start: int
    data_bytes: int


def has_magic(head: bytes) -> bool:
    """Whether bytes starting a file are a version 3 (or later) file's."""
    return head[: len(MAGIC)] == MAGIC


def parse(buf: Any, where: str, newest: int) -> Layout:
    """The layout of the file in `buf` (bytes-like, its whole content), every offset checked
    against its size. Raises CorruptBatchFile naming `where` and the fault; a version above
    `newest` is refused with a hint to upgrade."""
    size = len(buf)
    if size < PREFIX.size:
        raise CorruptBatchFile(f"{where}: truncated: {size} bytes, less than the 24-byte prefix")
    magic, version, reserved, header_len = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBatchFile(f"{where}: not a batch file: it starts with {bytes(magic)!r}")
    if version > newest:
        raise CorruptBatchFile(
            f"{where}: format version {version} is newer than this reader's {newest}; "
            "upgrade batchqueue on the client"
        )
    if version != VERSION or reserved != 0:
        raise CorruptBatchFile(
            f"{where}: prefix says version {version} (reserved {reserved}); the layout is "
            f"version {VERSION}'s with reserved 0"
        )
    if header_len > size - PREFIX.size:
        raise CorruptBatchFile(
            f"{where}: header length {header_len} runs past the end ({size} bytes)"
        )
    text = buf[PREFIX.size : PREFIX.size + header_len]  # bytes from an mmap, or a memoryview
    header = _header(text if isinstance(text, bytes) else bytes(text), where)
    data_start = _aligned(PREFIX.size + header_len)
    data_bytes = header["data_bytes"]
    if not _count(data_bytes) or data_start + data_bytes != size:
        raise CorruptBatchFile(
            f"{where}: {size} bytes, but the header says the data ({data_bytes!r} bytes) "
            f"starts at {data_start}"
        )
    tables = {t: _entries(header.get(t, []), t, data_bytes, where) for t in TABLES}
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for t in TABLES for e in tables[t])
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise CorruptBatchFile(f"{where}: tensors {a!r} and {b!r} overlap")
    return Layout(
        version, header["metadata"], tables["tensors"], tables["extras"], data_start, data_bytes
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON data")


# One decoder made once (json.loads with arguments makes one per call), refusing NaN/Infinity.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _header(text: bytes, where: str) -> dict[str, Any]:
    try:
        header = _DECODER.decode(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError are both
        raise CorruptBatchFile(f"{where}: the header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not header.keys() <= HEADER_KEYS:
        raise CorruptBatchFile(
            f"{where}: the header is not a table of {sorted(HEADER_KEYS)}: {str(header)[:200]}"
        )
    missing = sorted(HEADER_KEYS - {"extras"} - header.keys())
    if missing:
        raise CorruptBatchFile(f"{where}: the header lacks {missing}")
    if not isinstance(header["metadata"], dict):
        raise CorruptBatchFile(f"{where}: metadata is a {type(header['metadata']).__name__}")
    return header


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _entries(raw: Any, table: str, data_bytes: int, where: str) -> tuple[Entry, ...]:
    if not isinstance(raw, list):
        raise CorruptBatchFile(f"{where}: {table} is not a list of tensor entries")
    out = []
    names: set[str] = set()
    for e in raw:
        if not isinstance(e, dict) or e.keys() != ENTRY_KEYS:
            raise CorruptBatchFile(
                f"{where}: a {table} entry is not a table of {sorted(ENTRY_KEYS)}: {str(e)[:200]}"
            )
        name, dtype, shape, offset, nbytes = (e[k] for k in Entry.__dataclass_fields__)
        what = f"{where}: {table} tensor {name!r}"
        if not isinstance(name, str) or name in names:
            raise CorruptBatchFile(f"{what}: the name is not a str, or is repeated")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CorruptBatchFile(f"{what}: unknown dtype {dtype!r}")
        # Every stride (a product of later sizes, empty ones counted as 1) must fit int64.
        if (
            not isinstance(shape, list)
            or len(shape) > 64
            or not all(map(_count, shape))
            or math.prod(max(d, 1) for d in shape) > 2**62
        ):
            raise CorruptBatchFile(f"{what}: shape {str(shape)[:200]} is not a list of sizes")
        if not _count(offset) or offset % ALIGN or not _count(nbytes):
            raise CorruptBatchFile(
                f"{what}: offset {offset!r} is not a multiple of {ALIGN}, or nbytes {nbytes!r} "
                "is not a size"
            )
        if math.prod(shape) * ITEMSIZE[dtype] != nbytes:
            raise CorruptBatchFile(f"{what}: shape {shape} of {dtype} is not {nbytes} bytes")
        if offset + nbytes > data_bytes:
            raise CorruptBatchFile(
                f"{what}: bytes [{offset}, {offset + nbytes}) run past the data's {data_bytes}"
            )
        out.append(Entry(name, dtype, tuple(shape), offset, nbytes))
    return tuple(out)


def views(base: torch.Tensor, shift: int, entries: tuple[Entry, ...]) -> dict[str, torch.Tensor]:
    """Each entry's tensor as a view of `base` (uint8; data offset `o` at base[o + shift])."""
    import torch

    out = {}
    for e in entries:
        flat = base[shift + e.offset : shift + e.offset + e.nbytes]
        out[e.name] = flat.view(getattr(torch, e.dtype)).view(e.shape)
    return out


def arrays(buf: Any, layout: Layout) -> dict[str, np.ndarray]:
    """Each stored tensor of a parsed file as a read-only numpy view of `buf` (the file's
    bytes), for a writer that copies stored rows between files without torch (a mixture's
    worker). Raises ValueError naming a dtype numpy has no type for (bfloat16)."""
    out = {}
    for e in layout.tensors:
        if e.dtype not in NUMPY_DTYPES:
            raise ValueError(f"tensor {e.name!r} is {e.dtype}, which numpy does not hold")
        dtype = np.dtype(e.dtype)
        flat = np.frombuffer(buf, dtype, e.nbytes // dtype.itemsize, layout.data_start + e.offset)
        out[e.name] = flat.reshape(e.shape)
    return out
