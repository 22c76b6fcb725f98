"""A .npy file of one dimension of token ids, its header read by numpy.lib.format alone.

Only the header is parsed (never allow_pickle: an object array is refused before any of it
is read), and the file's size must hold the array the header describes.
"""

from __future__ import annotations

import io

import numpy as np
from numpy.lib import format as npy_format

from queue_client.errors import ConfigError
from queue_providers.remote import Location, shown
from queue_providers.token_shards.shard import Shard, check_dtype, read_head, size_of

# A .npy header of a 1-D array is under 200 bytes; numpy pads it to a multiple of 64.
HEAD_BYTES = 4096


def npy_header(location: Location) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of a .npy file, from its header only."""
    where = shown(location)
    with io.BytesIO(read_head(location, HEAD_BYTES)) as f:
        try:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npy_format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = npy_format.read_array_header_2_0(f)
            else:
                raise ValueError(f"format version {version} is unknown")
        except ValueError as exc:
            raise ConfigError(f"token_shards: {where} is not a readable .npy file: {exc}") from None
        return tuple(shape), bool(fortran), np.dtype(dtype), f.tell()


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
