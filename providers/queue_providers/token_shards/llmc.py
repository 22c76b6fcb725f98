"""llm.c / modded-nanogpt token shards: a header of 256 little-endian int32, then the ids.

header[0] is the magic 20240520, header[1] the version (1: uint16 ids, GPT-2's tokenizer),
header[2] the number of tokens that follow the 1024 header bytes. The file's size must be
exactly the header plus that many ids: a shorter file was cut off while it was written.
"""

from __future__ import annotations

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import Location, shown
from queue_providers.token_shards.shard import Shard, check_dtype, read_head, size_of

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSION_DTYPES = {1: np.dtype("<u2")}


def is_llmc(head: bytes) -> bool:
    """Whether a file's first bytes carry the llm.c shard magic."""
    return len(head) >= 4 and int(np.frombuffer(head[:4], dtype="<i4")[0]) == MAGIC


def read_llmc(location: Location, wanted: np.dtype | None) -> Shard:
    """The shard's ids, after checking magic, version and size against its header."""
    where = shown(location)
    head = read_head(location, HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise ConfigError(
            f"token_shards: {where} is {len(head)} bytes, shorter than the {HEADER_BYTES}-byte "
            "llm.c header: the file is truncated or not an llm.c shard"
        )
    header = np.frombuffer(head, dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ConfigError(
            f"token_shards: {where} has magic {magic} where an llm.c shard has {MAGIC}: it is "
            'not an llm.c shard (for a headerless file of ids use format = "raw")'
        )
    dtype = VERSION_DTYPES.get(version)
    if dtype is None:
        raise ConfigError(
            f"token_shards: {where} is llm.c shard version {version}; this reader knows "
            f"versions {sorted(VERSION_DTYPES)} (1 = uint16 ids)"
        )
    dtype = check_dtype(dtype, where, wanted)
    size = size_of(location)
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        raise ConfigError(
            f"token_shards: {where} is {size} bytes but its header says {count} tokens, "
            f"which take {expected} bytes with the header: the file is "
            f"{'truncated' if size < expected else 'longer than its header says'}"
        )
    return Shard(location, "llmc", dtype, HEADER_BYTES, count)
