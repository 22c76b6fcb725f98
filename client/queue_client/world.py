"""Rank arithmetic, named once: which seqs a rank reads, and where torchrun puts rank and size."""

from __future__ import annotations

import os
from dataclasses import dataclass

from queue_client.errors import InvalidRequest

# The most ranks a split is served to (the server refuses more, naming this bound).
MAX_WORLD_SIZE = 65536


@dataclass(frozen=True)
class World:
    """Rank r of world_size W reads the files whose seq is congruent to r modulo W, in order."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if (
            not isinstance(self.world_size, int)
            or isinstance(self.world_size, bool)
            or not 1 <= self.world_size <= MAX_WORLD_SIZE
        ):
            raise InvalidRequest(
                f"world_size {self.world_size!r} must be an int in [1, {MAX_WORLD_SIZE}]"
            )
        if (
            not isinstance(self.rank, int)
            or isinstance(self.rank, bool)
            or not 0 <= self.rank < self.world_size
        ):
            raise InvalidRequest(
                f"rank {self.rank!r} must lie in [0, world_size={self.world_size})"
            )

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> World:
        """Explicit values win; else torchrun's RANK and WORLD_SIZE; else a single process."""
        if rank is None:
            rank = _env_int("RANK", 0)
        if world_size is None:
            world_size = _env_int("WORLD_SIZE", 1)
        return cls(rank, world_size)

    @classmethod
    def owner_of(cls, seq: int, world_size: int) -> World:
        """The rank of world_size that reads `seq`."""
        return cls(seq % world_size, world_size)

    def owns(self, seq: int) -> bool:
        return seq % self.world_size == self.rank

    def first_seq_at_or_after(self, seq: int) -> int:
        """The smallest seq >= `seq` that this rank reads."""
        return seq + (self.rank - seq) % self.world_size


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"environment variable {name}={raw!r} is not an integer") from None
