"""Composer snapshots (composer-<seq>.npz), split out of composer.py to keep it short.

They read and write a composer through Snapshotted, the state a snapshot holds, which Composer
(composer.py) implements: composer.py imports this module, not the reverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from queue_client.format.layout import atomic_write

SNAPSHOT_VERSION = 1
# The composer's integer state, in snapshot order after the version.
_SNAPSHOT_COUNTERS = ("served_tokens", "next_candidate", "plans", "ingested", "culled", "picked")


class Snapshotted(Protocol):
    """A composer's state: the counters below, alpha, served counts and the buffer."""

    served_tokens: int
    next_candidate: int
    plans: int
    ingested: int
    culled: int
    picked: int
    alpha: float
    served: np.ndarray  # per token
    cand: np.ndarray  # the buffer: candidate seq, batch index in it, served seq it came in at
    index: np.ndarray
    born: np.ndarray

    def forget_derived(self) -> None:
        """Drop what is rebuilt from the state on next use (pool, plan, mapped files)."""
        ...


def save_snapshot(composer: Snapshotted, path: Path) -> None:
    """Write the composer's state (composer-<seq>.npz) atomically."""
    scalars = np.array(
        [SNAPSHOT_VERSION, *(getattr(composer, name) for name in _SNAPSHOT_COUNTERS)], np.int64
    )
    arrays = {
        "scalars": scalars,
        "alpha": np.array([composer.alpha]),
        "served": composer.served,
        "cand": composer.cand,
        "index": composer.index,
        "born": composer.born,
    }
    atomic_write(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]


def restore_snapshot(composer: Snapshotted, path: Path) -> None:
    """Load a state written by save_snapshot; the pool and files are rebuilt on next use."""
    with np.load(path, allow_pickle=False) as z:
        scalars = z["scalars"]
        if int(scalars[0]) != SNAPSHOT_VERSION:
            raise ValueError(f"{path}: composer snapshot version {int(scalars[0])} is unknown")
        if z["served"].shape != composer.served.shape:
            raise ValueError(f"{path}: composer snapshot is for another vocab size")
        for name, value in zip(_SNAPSHOT_COUNTERS, scalars[1:], strict=True):
            setattr(composer, name, int(value))
        composer.alpha = float(z["alpha"][0])
        composer.served = z["served"].astype(np.int64)
        composer.cand, composer.index, composer.born = z["cand"], z["index"], z["born"]
    composer.forget_derived()
