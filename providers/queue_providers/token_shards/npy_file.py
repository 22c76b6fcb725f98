"""A .npy file of one dimension of token ids, its header read by numpy.lib.format alone.

Only the header is parsed (never allow_pickle: an object array is refused before any of it
is read), and the file's size must hold the array the header describes. The header's length
is read from its prefix (2 bytes in format 1.0, 4 in 2.0 and 3.0), so a header of any
length numpy writes is read whole; one over MAX_HEADER_BYTES is refused unparsed.
"""

from __future__ import annotations

import io

import numpy as np
from numpy.lib import format as npy_format

from queue_client.errors import ConfigError
from queue_providers.remote import Location, RemoteObject, shown
from queue_providers.token_shards.shard import Shard, check_dtype, read_head, size_of

# A .npy header of a 1-D array is under 200 bytes (numpy pads it to a multiple of 64), so one
# read of this many bytes holds it; a longer header costs a second read of its exact length.
HEAD_BYTES = 4096
# numpy's own reader refuses headers over 10,000 bytes unless told otherwise (parsing a huge
# one is slow); valid ones may be longer (format 2.0 exists for them), so the bound is wider.
MAX_HEADER_BYTES = 1 << 20


def npy_header(location: Location) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of a .npy file, from its header only."""
    where = shown(location)
    head = read_head(location, HEAD_BYTES)
    try:
        version, prefix, length = _header_length(head)
    except ValueError as exc:
        raise ConfigError(f"token_shards: {where} is not a readable .npy file: {exc}") from None
    if length > MAX_HEADER_BYTES:
        raise ConfigError(
            f"token_shards: {where} has a header of {length} bytes, over the "
            f"{MAX_HEADER_BYTES} this reader parses: it is not a token array's header"
        )
    if len(head) < prefix + length:
        head = read_head(location, prefix + length)
    read = npy_format.read_array_header_1_0
    if version != (1, 0):
        read = npy_format.read_array_header_2_0
    with io.BytesIO(head) as f:
        try:
            npy_format.read_magic(f)
            shape, fortran, dtype = read(f, max_header_size=MAX_HEADER_BYTES)
        except ValueError as exc:
            raise ConfigError(f"token_shards: {where} is not a readable .npy file: {exc}") from None
        return tuple(shape), bool(fortran), np.dtype(dtype), f.tell()


def _header_length(head: bytes) -> tuple[tuple[int, int], int, int]:
    """(format version, bytes before the header, the header's length) from a .npy file's
    first bytes: magic and version, then the length in 2 bytes (1.0) or 4 (2.0, 3.0)."""
    version = npy_format.read_magic(io.BytesIO(head))
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"format version {version} is unknown")
    width = 2 if version == (1, 0) else 4
    if len(head) < 8 + width:
        raise ValueError(f"the file is {len(head)} bytes, shorter than a header")
    return version, 8 + width, int.from_bytes(head[8 : 8 + width], "little")


def npy_values(location: Location, what: str, kinds: str, limit: int | None = None) -> np.ndarray:
    """The 1-D array of a small .npy (a shard's document starts), read after its header says
    it holds ints of a kind in `kinds`: mapped locally, one ranged read at a URL; only its
    first `limit` values when given. No pickle can be loaded: the dtype is checked before a
    byte of data is read."""
    where = shown(location)
    shape, _, dtype, offset = npy_header(location)
    if len(shape) != 1 or dtype.hasobject or dtype.kind not in kinds:
        raise ConfigError(f"token_shards: {where} holds {dtype} {shape}, expected 1-D {what}")
    size = size_of(location)
    if size != offset + shape[0] * dtype.itemsize:
        raise ConfigError(
            f"token_shards: {where} is {size} bytes but its header describes {shape[0]} {dtype} "
            f"values ({offset + shape[0] * dtype.itemsize} bytes)"
        )
    count = shape[0] if limit is None else min(limit, shape[0])
    if count == 0:
        return np.zeros(0, dtype=dtype)
    if isinstance(location, RemoteObject):
        data = location.store.fetch(location, offset, offset + count * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)
    return np.memmap(location, dtype, "r", offset, (count,))


def read_npy(location: Location, wanted: np.dtype | None) -> Shard:
    """The .npy array as a shard; ConfigError naming the file for a shape, dtype or size that
    is not a flat array of token ids."""
    where = shown(location)
    shape, _, dtype, offset = npy_header(location)
    if dtype.hasobject:
        raise ConfigError(f"token_shards: {where} holds Python objects; token ids are integers")
    if len(shape) != 1:
        raise ConfigError(
            f"token_shards: {where} holds an array of shape {shape}; a token shard is 1-D"
        )
    dtype = check_dtype(dtype, where, wanted)
    size = size_of(location)
    expected = offset + shape[0] * dtype.itemsize
    if size != expected:
        raise ConfigError(
            f"token_shards: {where} is {size} bytes but its header describes {shape[0]} "
            f"{dtype.name} tokens ({expected} bytes): the file is "
            f"{'truncated' if size < expected else 'longer than its header says'}"
        )
    return Shard(location, "npy", dtype, offset, shape[0])
