"""A composer's token classes and its candidate files' batches as rows, as scoring reads them.

Split from scoring.py so that the pool (pool.py) and the scoring (scoring.py) both import
what they share, and neither imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from queue_server.curriculum.candidate_files import CandidateFile

# Head columns: a float32 matrix of buffer x HEAD_TOKENS (1,000 x 2,048 = 8 MB), multiplied
# once per pick. Fewer columns leave more tokens to the tail and more exact rows per pick.
HEAD_TOKENS = 2048
# Tail tokens from this corpus rank on are rare: few batches hold each, and serving one moves
# its weight most, so each pick tightens the kept sums of the batches that hold its rare
# tokens (an index by token; a few thousand entries per pick).
RARE_FROM = 16384


@dataclass(frozen=True)
class TokenClasses:
    """Head, tail and rare tokens: a pure function of the corpus distribution (ties to the
    lower id), so every composer of a split agrees on them."""

    column: np.ndarray  # per token: its head column, or -1 for a tail token
    head: np.ndarray  # the head tokens, in column (id) order
    rare: np.ndarray  # per token: a tail token indexed for tightening

    @property
    def width(self) -> int:
        return len(self.head)

    @classmethod
    def of(
        cls, corpus: np.ndarray, head: int = HEAD_TOKENS, rare_from: int = RARE_FROM
    ) -> TokenClasses:
        ranked = np.argsort(-corpus, kind="stable")
        top = ranked[:head]
        top = np.sort(top[corpus[top] > 0])
        column = np.full(len(corpus), -1, np.int64)
        column[top] = np.arange(len(top))
        rare = np.ones(len(corpus), bool)
        rare[ranked[:rare_from]] = False
        rare[top] = False
        return cls(column, top, rare)


@dataclass
class FileRows:
    """One candidate file's batches as scoring reads them, made once when it is attached: per
    batch its entries (token, count, count * corpus), head tokens first and then tail tokens,
    each in id order; its head counts as dense float32 rows; and its rare entries sorted by
    token."""

    tok: np.ndarray
    cnt: np.ndarray
    ca: np.ndarray
    start: np.ndarray  # per batch: where its entries start
    head_len: np.ndarray  # per batch: its head entries, then tail_len tail entries
    tail_len: np.ndarray
    head32: np.ndarray  # batches x width, float32 counts (exact below 2**24)
    rare_tok: np.ndarray
    rare_batch: np.ndarray
    rare_cnt: np.ndarray
    rare_ca: np.ndarray

    @property
    def length(self) -> np.ndarray:
        """Entries per batch."""
        return self.head_len + self.tail_len

    @classmethod
    def build(cls, cf: CandidateFile, classes: TokenClasses, corpus: np.ndarray) -> FileRows:
        nb = len(cf.offsets) - 1
        lens = np.diff(cf.offsets).astype(np.int64)
        row = np.repeat(np.arange(nb, dtype=np.int64), lens)
        cols = classes.column[cf.ids]
        is_tail = cols < 0
        order = np.argsort(row * 2 + is_tail, kind="stable")  # per batch: head, then tail
        tok, cnt = cf.ids[order], cf.counts[order]
        ca = cnt * corpus[tok]
        tail_len = np.bincount(row[is_tail], minlength=nb).astype(np.int64)
        head32 = np.zeros((nb, classes.width), np.float32)
        head32[row[~is_tail], cols[~is_tail]] = cf.counts[~is_tail]
        tail_row = row[is_tail]
        tail_tok, tail_cnt = cf.ids[is_tail], cf.counts[is_tail]
        is_rare = classes.rare[tail_tok]
        by_token = np.argsort(tail_tok[is_rare], kind="stable")
        rare_tok = tail_tok[is_rare][by_token]
        rare_cnt = tail_cnt[is_rare][by_token]
        return cls(
            tok=tok,
            cnt=cnt,
            ca=ca,
            start=cf.offsets[:-1].astype(np.int64),
            head_len=lens - tail_len,
            tail_len=tail_len,
            head32=head32,
            rare_tok=rare_tok,
            rare_batch=tail_row[is_rare][by_token],
            rare_cnt=rare_cnt,
            rare_ca=rare_cnt * corpus[rare_tok],
        )
