"""The token stream cut into shards of exactly `shard_tokens`, and where each shard ends.

Pieces arrive in order; their tokens form one stream, cut every `shard_tokens` tokens (the
last shard keeps the rest). One shard's tokens are gathered in one preallocated array, so
memory is one shard plus the pieces in flight. After each shard is written the sharder knows
the stream's position where the next one begins, as (piece, token offset in that piece), and
whether that position is inside a document: that is the whole resume point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from queue_providers.prepare.encode import EncodedPiece
from queue_providers.prepare.layout import ShardRecord, write_shard


@dataclass(frozen=True)
class ResumePoint:
    """Where the next shard's first token is: token `offset` of piece `piece`."""

    piece: int
    offset: int
    continues_document: bool

    def to_json(self) -> dict[str, object]:
        return {
            "piece": self.piece,
            "offset": self.offset,
            "continues_document": self.continues_document,
        }


class Sharder:
    """Feed pieces in order with `add`; each call returns the shards it completed."""

    def __init__(self, out: Path, shard_tokens: int, dtype: str, start: int, at: ResumePoint):
        self.out = out
        self.shard_tokens = shard_tokens
        self.index = start
        self.at = at
        self._buf = np.empty(shard_tokens, dtype=np.dtype(dtype))
        self._fill = 0
        self._starts: list[np.ndarray] = []
        self._continues = at.continues_document

    def add(self, piece: EncodedPiece) -> list[tuple[ShardRecord, ResumePoint]]:
        """Take one piece (its tokens from the resume offset on, if it is the first)."""
        tokens, n = piece.tokens, len(piece.tokens)
        starts = np.cumsum(piece.lengths) - piece.lengths  # each document's first token
        pos = self.at.offset if piece.index == self.at.piece else 0
        written = []
        while pos < n:
            take = min(self.shard_tokens - self._fill, n - pos)
            self._buf[self._fill : self._fill + take] = tokens[pos : pos + take]
            lo, hi = np.searchsorted(starts, [pos, pos + take])
            self._starts.append(starts[lo:hi] - pos + self._fill)
            self._fill += take
            pos += take
            if self._fill == self.shard_tokens:
                nxt = (
                    ResumePoint(piece.index, pos, not _is_start(starts, pos))
                    if pos < n
                    else ResumePoint(piece.index + 1, 0, False)  # a piece ends with an EOS
                )
                written.append((self._flush(), nxt))
                self._continues = nxt.continues_document
        return written

    def finish(self) -> ShardRecord | None:
        """The last, shorter shard, if any tokens are left."""
        return self._flush() if self._fill else None

    def _flush(self) -> ShardRecord:
        starts = np.concatenate(self._starts) if self._starts else np.empty(0, np.int64)
        record = write_shard(self.out, self.index, self._buf[: self._fill], starts, self._continues)
        self.index += 1
        self._fill = 0
        self._starts = []
        return record


def _is_start(starts: np.ndarray, pos: int) -> bool:
    i = int(np.searchsorted(starts, pos))
    return i < len(starts) and int(starts[i]) == pos
