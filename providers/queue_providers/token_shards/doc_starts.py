"""Checks of an index read from disk, before documents are packed from it.

order = "documents" lays a shard's documents end to end, each from its start to the next
one's; a start that is unsorted, negative or past the shard's end would make two documents
cover the same tokens (or wrap round through numpy's negative indexing), so a token would be
served twice in an epoch with nothing said. So every entry is checked where it is read, with
a few vectorised passes (no Python loop over entries), and the first bad one is named: the
file, the entry's index and its value. ConfigError: the file is wrong and no retry mends it.
"""

from __future__ import annotations

import numpy as np

from queue_client.errors import ConfigError


def first_bad(bad: np.ndarray) -> int | None:
    """The index of the first True in `bad`, or None."""
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def check_doc_starts(
    starts: np.ndarray, tokens: int, documents: int | None, where: str, *, first_zero: bool
) -> np.ndarray:
    """A prepared shard's document starts as int64, once each is known to lie in the shard
    ([0, tokens): a document starts in the shard that lists it), in order, as many as the
    manifest says, and the first at 0 when the shard starts with a document."""
    starts = np.asarray(starts, dtype=np.int64)
    if documents is not None and len(starts) != documents:
        raise ConfigError(
            f"token_shards: {where} holds {len(starts)} document starts but the manifest says "
            f"{documents} documents"
        )
    i = first_bad((starts < 0) | (starts >= tokens))
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: entry {i} is {int(starts[i])}, outside the shard's "
            f"{tokens} tokens (a document starts at an offset in [0, {tokens}))"
        )
    i = first_bad(starts[1:] < starts[:-1])
    if i is not None:
        raise ConfigError(
            f"token_shards: {where}: entry {i + 1} is {int(starts[i + 1])}, below entry {i} "
            f"({int(starts[i])}): document starts must be sorted"
        )
    if first_zero and len(starts) and starts[0] != 0:
        raise ConfigError(
            f"token_shards: {where}: entry 0 is {int(starts[0])}, but the manifest says "
            "continues_document = false: a shard that starts with a document lists offset 0"
        )
    return starts
