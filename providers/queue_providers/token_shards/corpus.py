"""A split's corpus: its shards laid end to end, cut into windows that never cross a shard.

Window k of a shard holds tokens [k*T, k*T + T + 1): x and y of nanoGPT at stride T, so a
shard of t tokens has (t - 1) // T windows and the last few tokens of a shard may go unread.
The index is a few numbers per shard (never per token), so it costs the same for 100 MB as
for a terabyte; locating windows is one searchsorted over the shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from queue_providers.token_shards.shard import Shard


class CorpusIndex:
    """Global window numbers, and nanoGPT's random starts, mapped to (shard, token start)."""

    def __init__(self, shards: Sequence[Shard], block_size: int) -> None:
        self.shards = tuple(shards)
        self.block_size = block_size
        tokens = np.array([s.tokens for s in self.shards], dtype=np.int64)
        self.tokens = int(tokens.sum())
        per_shard = np.where(tokens > block_size, (tokens - 1) // block_size, 0)
        self.first_window = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)
        self.n_windows = int(self.first_window[-1])
        # nanoGPT draws a start i in [0, t - T): every start whose y fits in the shard.
        starts = np.maximum(tokens - block_size, 0)
        self.first_start = np.concatenate([[0], np.cumsum(starts)]).astype(np.int64)
        self.n_starts = int(self.first_start[-1])

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, first token) of each global window number."""
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        return shard, (windows - self.first_window[shard]) * self.block_size

    def locate_start(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, first token) of each of nanoGPT's starts numbered over all shards."""
        shard = np.searchsorted(self.first_start, starts, side="right") - 1
        return shard, starts - self.first_start[shard]
