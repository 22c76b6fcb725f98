"""One shard of a token corpus: where its flat token array lies, and how to read windows of it.

Every format reader (raw, llm.c, .npy, Megatron, prepared) ends in a `Shard`: a location (a
local path or an object at a URL), the byte offset of the first token, the token dtype and
count, and where its document starts are, if the format knows them. Nothing is read at start
but headers: a local shard is memory-mapped when first used (the map costs address space,
not memory), a remote one is read by range through the input cache's blocks.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, RemoteObject, shown

# The token dtypes a shard may hold. int32 is Megatron's choice past 65,500 ids; its ids are
# checked like any others (never negative, below vocab_size) before a batch is written.
TOKEN_DTYPES = (np.dtype("<u2"), np.dtype("<u4"), np.dtype("<i4"))


@dataclass(frozen=True, eq=False)
class Shard:
    """A flat array of `tokens` ids of `dtype` at byte `offset` of `location`."""

    location: Location
    format: str
    dtype: np.dtype
    offset: int
    tokens: int
    # The int64 start of each document in the shard, loaded only when asked for (None when
    # the format does not record documents).
    doc_starts: Callable[[], np.ndarray] | None = None
    # Checks, from headers only, that doc_starts() can be read: called at start when the
    # documents are needed (ConfigError naming the file when not).
    check_documents: Callable[[], None] | None = None
    # How many tokens at its start end the previous shard's last document (a prepared shard
    # whose manifest says continues_document; all of them when no document starts in it),
    # read when asked for; None when the shard starts with a document of its own.
    continuation: Callable[[], int] | None = None

    @property
    def shown(self) -> str:
        return shown(self.location)


def size_of(location: Location) -> int:
    """The location's size in bytes; ConfigError naming it when it cannot be read."""
    if isinstance(location, RemoteObject):
        return location.size
    try:
        return Path(location).stat().st_size
    except OSError as exc:
        raise ConfigError(f"token_shards: {location} cannot be read: {exc.strerror}") from None


def read_head(location: Location, n: int) -> bytes:
    """The first `n` bytes (fewer when the file is shorter); at a URL, one ranged read of
    just those bytes, not a cache block, so a start over many remote shards stays small."""
    if isinstance(location, RemoteObject):
        return location.store.fetch(location, 0, min(n, location.size))
    with open_binary(location) as f:
        return f.read(n)


def open_binary(location: Location) -> Any:
    """A buffered binary file of a local path or a remote object (read by range)."""
    if isinstance(location, RemoteObject):
        return io.BufferedReader(location.open(), buffer_size=1 << 16)
    try:
        return open(location, "rb")
    except OSError as exc:
        raise ConfigError(f"token_shards: {location} cannot be read: {exc.strerror}") from None


def check_dtype(dtype: np.dtype, where: str, wanted: np.dtype | None) -> np.dtype:
    """`dtype` as a little-endian token dtype, or ConfigError naming the file."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">" or dtype.newbyteorder("<") not in TOKEN_DTYPES:
        raise ConfigError(
            f"token_shards: {where} holds {dtype} values; token ids must be uint16 or uint32 "
            "(little-endian)"
        )
    dtype = dtype.newbyteorder("<")
    if wanted is not None and dtype != wanted:
        raise ConfigError(
            f"token_shards: {where} holds {dtype.name} tokens but token_dtype = "
            f"{wanted.name!r} in config: convert the file or set token_dtype to match it"
        )
    return dtype


class ShardReader:
    """Windows of one shard: a memory map of a local file, range reads of a remote one."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self._map: np.ndarray | None = None
        self._file: Any = None

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] tokens in the shard's dtype, row i = tokens[starts[i]:+length]."""
        s = self.shard
        if isinstance(s.location, RemoteObject):
            return self._remote_windows(starts, length)
        return self.local_map()[starts[:, None] + np.arange(length)]

    def local_map(self) -> np.ndarray:
        """The local shard's tokens, memory-mapped on first use."""
        if self._map is None:
            s = self.shard
            assert not isinstance(s.location, RemoteObject)
            self._map = np.memmap(
                s.location, dtype=s.dtype, mode="r", offset=s.offset, shape=(s.tokens,)
            )
        return self._map

    def take(self, index: np.ndarray) -> np.ndarray:
        """The tokens at `index` (any shape), in the shard's dtype."""
        s = self.shard
        if not isinstance(s.location, RemoteObject):
            return self.local_map()[index]
        flat = index.reshape(-1)
        out = np.empty(flat.shape, dtype=s.dtype)
        # Runs of consecutive indices, each one ranged read.
        breaks = np.nonzero(np.diff(flat) != 1)[0] + 1
        for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(flat)], strict=True):
            out[lo:hi] = self._remote_windows(flat[lo : lo + 1], hi - lo)[0]
        return out.reshape(index.shape)

    def _remote_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        s = self.shard
        if self._file is None:
            assert isinstance(s.location, RemoteObject)
            self._file = s.location.open()
        out = np.empty((len(starts), length), dtype=s.dtype)
        nbytes = length * s.dtype.itemsize
        for row, start in enumerate(starts.tolist()):
            self._file.seek(s.offset + start * s.dtype.itemsize)
            data = self._file.read(nbytes)
            if len(data) != nbytes:
                raise ValueError(
                    f"token_shards: {s.shown} ended at byte {s.offset + start * s.dtype.itemsize + len(data)}, "
                    f"inside a window its header promised (it changed or was cut short)"
                )
            out[row] = np.frombuffer(data, dtype=s.dtype)
        return out
