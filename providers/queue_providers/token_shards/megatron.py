"""A Megatron-LM indexed dataset: token ids in PREFIX.bin, their layout in PREFIX.idx.

The .idx, as Megatron-LM's indexed_dataset describes it, all little-endian:
  9 bytes  magic b"MMIDIDX\\x00\\x00"
  uint64   version (1)
  uint8    dtype code of the .bin (8: uint16, 4: int32; the other codes are not token ids)
  uint64   sequence count S
  uint64   document count D (entries of the document index: documents + 1)
  int32[S] sequence lengths, in tokens
  int64[S] sequence pointers, byte offsets into the .bin
  int64[D] document index: the first sequence of each document, then S
Only the fixed header and the last sequence's length and pointer are read at start; the
arrays are memory-mapped (read by range at a URL) when documents are first asked for, and
then every entry is checked (doc_starts.py says why): each sequence lies in the .bin, in
order, and the document index runs in order from 0 to S.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, RemoteObject, shown
from queue_providers.token_shards.doc_starts import first_bad
from queue_providers.token_shards.shard import Shard, check_dtype, read_head, size_of

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}


def read_megatron(bin_location: Location, idx_location: Location, wanted: np.dtype | None) -> Shard:
    """The .bin's ids as one shard, its documents from the .idx; ConfigError naming the file
    for a wrong magic, version or dtype, or a .idx or .bin shorter than it says."""
    where = shown(idx_location)
    head = read_head(idx_location, HEADER.size)
    if len(head) < HEADER.size:
        raise ConfigError(
            f"token_shards: {where} is {len(head)} bytes, shorter than a Megatron index header "
            f"({HEADER.size} bytes): it is truncated or not a .idx"
        )
    magic, version, code, sequences, doc_entries = HEADER.unpack(head)
    if magic != MAGIC:
        raise ConfigError(
            f"token_shards: {where} starts with {magic!r}, not the Megatron index magic {MAGIC!r}"
        )
    if version != VERSION:
        raise ConfigError(
            f"token_shards: {where} is Megatron index version {version}; this reader knows {VERSION}"
        )
    if code not in DTYPE_CODES:
        raise ConfigError(
            f"token_shards: {where} names dtype code {code}, which Megatron does not define"
        )
    dtype = check_dtype(
        DTYPE_CODES[code], f"{shown(bin_location)} (dtype code {code} in {where})", wanted
    )
    lengths_at = HEADER.size
    pointers_at = lengths_at + 4 * sequences
    docs_at = pointers_at + 8 * sequences
    needed = docs_at + 8 * doc_entries
    idx_size = size_of(idx_location)
    if idx_size < needed:
        raise ConfigError(
            f"token_shards: {where} is {idx_size} bytes but its header says {sequences} "
            f"sequences and {doc_entries} document entries, which take {needed}: it is truncated"
        )
    tokens = 0
    if sequences:
        last_length = int(_ints(idx_location, lengths_at + 4 * (sequences - 1), 1, "<i4")[0])
        last_pointer = int(_ints(idx_location, pointers_at + 8 * (sequences - 1), 1, "<i8")[0])
        end = last_pointer + last_length * dtype.itemsize
        tokens = end // dtype.itemsize
    bin_size = size_of(bin_location)
    if bin_size != tokens * dtype.itemsize:
        raise ConfigError(
            f"token_shards: {shown(bin_location)} is {bin_size} bytes but {where} describes "
            f"{tokens} {dtype.name} tokens ({tokens * dtype.itemsize} bytes): the .bin is "
            f"{'truncated' if bin_size < tokens * dtype.itemsize else 'longer than its index says'}"
        )

    def doc_starts() -> np.ndarray:
        return _doc_starts(
            idx_location,
            (lengths_at, pointers_at, docs_at),
            sequences,
            doc_entries,
            dtype,
            bin_location,
        )

    return Shard(bin_location, "megatron", dtype, 0, tokens, doc_starts)


def _ints(location: Location, offset: int, count: int, dtype: str) -> np.ndarray:
    """`count` little-endian ints at byte `offset` of the .idx: a memory map of a local file,
    one ranged read at a URL (the index of a large corpus is never copied whole)."""
    if isinstance(location, RemoteObject):
        data = location.store.fetch(location, offset, offset + count * np.dtype(dtype).itemsize)
        return np.frombuffer(data, dtype=dtype)
    return np.memmap(location, dtype, "r", offset, (count,))


def _doc_starts(
    idx_location: Location,
    offsets: tuple[int, int, int],
    sequences: int,
    doc_entries: int,
    dtype: np.dtype,
    bin_location: Location,
) -> np.ndarray:
    """The token offset of each document's first sequence (the .bin's end for an empty last
    document), once every entry of the index is checked; ConfigError naming the .idx and the
    first bad entry. Costs a few int64 arrays of S entries, as the starts themselves do."""
    if not sequences:
        return np.zeros(0, dtype=np.int64)
    where, size = shown(idx_location), dtype.itemsize
    lengths_at, pointers_at, docs_at = offsets
    lengths = np.asarray(_ints(idx_location, lengths_at, sequences, "<i4"), dtype=np.int64)
    pointers = np.asarray(_ints(idx_location, pointers_at, sequences, "<i8"), dtype=np.int64)
    end = int(pointers[-1]) + int(lengths[-1]) * size  # the .bin's size, checked at start
    i = first_bad(lengths < 0)
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: sequence length [{i}] is {int(lengths[i])}, below 0"
        )
    i = first_bad((pointers < 0) | (pointers % size != 0))
    if i is not None:
        why = "below 0" if pointers[i] < 0 else f"not a multiple of {size} ({dtype.name} tokens)"
        raise ConfigError(
            f"token_shards: {where}: sequence pointer [{i}] is byte {int(pointers[i])}, {why}"
        )
    i = first_bad((pointers > end) | (np.minimum(pointers, end) + lengths * size > end))
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: sequence [{i}] (byte {int(pointers[i])}, {int(lengths[i])} "
            f"tokens) runs past the end of {shown(bin_location)} ({end} bytes)"
        )
    i = first_bad(pointers[1:] < pointers[:-1])
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: sequence pointer [{i + 1}] is byte {int(pointers[i + 1])}, "
            f"before sequence pointer [{i}] (byte {int(pointers[i])}): sequences lie in order"
        )
    first_sequence = _document_index(idx_location, docs_at, doc_entries, sequences)
    return np.concatenate([pointers, [end]])[first_sequence] // size


def _document_index(location: Location, at: int, entries: int, sequences: int) -> np.ndarray:
    """Each document's first sequence: the index without its last entry, once it is known
    to run in order from 0 to `sequences`."""
    where = shown(location)
    if entries == 0:
        raise ConfigError(
            f"token_shards: {where}: the document index is empty; it runs from 0 to the "
            f"sequence count, {sequences}"
        )
    index = np.asarray(_ints(location, at, entries, "<i8"), dtype=np.int64)
    i = first_bad((index < 0) | (index > sequences))
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: document index [{i}] is {int(index[i])}, outside "
            f"[0, {sequences}] ({sequences} sequences)"
        )
    if index[0] != 0:
        raise ConfigError(
            f"token_shards: {where}: document index [0] is {int(index[0])}; the index starts at 0"
        )
    if index[-1] != sequences:
        raise ConfigError(
            f"token_shards: {where}: document index [{entries - 1}] is {int(index[-1])}; the "
            f"index ends with the sequence count, {sequences}"
        )
    i = first_bad(index[1:] < index[:-1])
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: document index [{i + 1}] is {int(index[i + 1])}, below "
            f"entry {i} ({int(index[i])}): it must be sorted"
        )
    return index[:-1]


def megatron_pair(path: Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx) for either name: input files, outside the data root."""
    return path.with_suffix(".bin"), path.with_suffix(".idx")
