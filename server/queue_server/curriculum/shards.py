"""How the composers of one split share its buffer (`composer_workers`): which batches each
one scores, and which of their proposals is the pick. No numpy here: the server's event loop
combines the proposals, and it never imports numpy.

Every composer keeps the whole buffer's bookkeeping (which batches, the served counts, the
picks) and scores only its own share, a partition of the candidate stream by (candidate seq,
batch index). A batch's exact score depends on its own histogram and the served counts alone
(scoring.py), so the best of the composers' bests is the batch one composer would pick,
whichever composer answers first and however many there are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def owned(cand: Any, index: Any, per_file: int, shard: int, shards: int) -> Any:
    """Which buffered batches (arrays of candidate seq and batch index) composer `shard` of
    `shards` scores."""
    return (cand * per_file + index) % shards == shard


def best_of(proposals: Sequence[Sequence[float] | None]) -> int:
    """The buffer position of the pick among the composers' proposals [score, position] (None
    from a composer with no batch left): the highest score, the oldest (lowest position) on a
    tie."""
    found = [(float(p[0]), -int(p[1])) for p in proposals if p is not None]
    if not found:
        raise ValueError("no composer proposed a batch: the buffer is empty")
    return -max(found)[1]
