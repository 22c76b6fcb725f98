"""The order of an epoch's windows: a keyed permutation of [0, n), computed per index.

A table of n indices would cost memory in proportion to the corpus; a Feistel network does
not. Indices are split into two halves of h bits (4**h >= n), put through a few rounds of
L, R = R, L ^ F(R, key_round) (a bijection of [0, 4**h) whatever F is), and an output at or
past n is put through again (cycle-walking) until it lands in [0, n): a bijection of [0, n)
that takes at most a few passes since 4**h < 4n. Keys come from (seed, split, epoch), so each
epoch has its own order and any process computes the same one. Everything is vectorised:
one call permutes a whole file's rows.
"""

from __future__ import annotations

import numpy as np

from queue_providers.seeding import derive_seed

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of values ^ key: every output bit depends on every input bit."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class EpochOrder:
    """perm_epoch(i) for a split of n windows; rows r map to (r // n, perm_{r // n}(r % n))."""

    def __init__(self, n: int, seed: int, split: str) -> None:
        if n <= 0:
            raise ValueError(f"an epoch needs at least one window, got n={n}")
        self.n = n
        self.seed = seed
        self.split = split
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)

    def keys(self, epoch: int) -> list[np.uint64]:
        return [
            np.uint64(derive_seed(self.seed, self.split, "epoch", epoch, r)) for r in range(ROUNDS)
        ]

    def _encrypt(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        h = np.uint64(self.half_bits)
        left, right = x >> h, x & self._mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & self._mask)
        return (left << h) | right

    def permute(self, epoch: int, index: np.ndarray) -> np.ndarray:
        """perm_epoch of each index (all in [0, n)), as int64."""
        keys = self.keys(epoch)
        out = self._encrypt(np.asarray(index, dtype=np.uint64), keys)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside], keys)
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def windows(self, rows: np.ndarray) -> np.ndarray:
        """The window each global row reads: epoch r // n, position r % n of its order."""
        rows = np.asarray(rows, dtype=np.int64)
        epochs, positions = np.divmod(rows, self.n)
        out = np.empty_like(rows)
        for epoch in np.unique(epochs).tolist():
            at = epochs == epoch
            out[at] = self.permute(int(epoch), positions[at])
        return out
