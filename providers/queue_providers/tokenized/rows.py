"""Fixed-width rows, [CLS] a [SEP] (b [SEP]) [PAD]..., laid out for a whole batch at once.

A RowLayout says what each position of each row holds and where in the flat token array its
token comes from; input_ids, labels, attention_mask and token_type_ids are then a few numpy
ops over the whole batch (a table lookup per role, one gather), with no loop per row or token.
numpy rather than torch because a row batch is small (B*T of a few thousand): torch's fixed
cost per op, several times numpy's, would be most of the time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike

# The label of positions with nothing to predict (torch's cross_entropy default ignore_index).
IGNORE_INDEX = -100

# What each position of a row holds.
ROLE_PAD, ROLE_CLS, ROLE_A, ROLE_SEP, ROLE_B, ROLE_SEP_B = range(6)


@dataclass(frozen=True)
class RowLayout:
    """Where each position of a batch of rows comes from: `src` indexes the flat array at
    content positions (ROLE_A, ROLE_B) and is 0 elsewhere."""

    role: np.ndarray  # [B, W] int8, a ROLE_*
    src: np.ndarray  # [B, W] int64

    @property
    def content(self) -> np.ndarray:
        return _IS_CONTENT[self.role]

    def gather(self, flat: np.ndarray) -> np.ndarray:
        """flat[src] as int64 (garbage where not content; callers mask it)."""
        return np.asarray(flat[self.src], dtype=np.int64)

    def input_ids(self, flat: np.ndarray, *, cls: int, sep: int, pad: int) -> torch.Tensor:
        special = np.array([pad, cls, 0, sep, 0, sep], dtype=np.int64)  # by role
        return torch.from_numpy(np.where(self.content, self.gather(flat), special[self.role]))

    def labels(self, flat: np.ndarray) -> torch.Tensor:
        """flat[src] at content positions, IGNORE_INDEX elsewhere."""
        return torch.from_numpy(np.where(self.content, self.gather(flat), IGNORE_INDEX))

    def attention_mask(self) -> torch.Tensor:
        return torch.from_numpy((self.role != ROLE_PAD).astype(np.int64))

    def token_type_ids(self) -> torch.Tensor:
        return torch.from_numpy(_TYPE[self.role])


# Lookups by role: is it a token of the text, and which segment (token_type_id) is it in.
_IS_CONTENT = np.array([False, False, True, False, True, False])
_TYPE = np.array([0, 0, 0, 0, 1, 1], dtype=np.int64)


def single_rows(starts: ArrayLike, lengths: ArrayLike, width: int) -> RowLayout:
    """[CLS] seq [SEP] [PAD]...: each seq truncated to width-2, keeping its start."""
    p = np.arange(width)
    n = np.minimum(np.asarray(lengths, dtype=np.int64), width - 2)[:, None]
    role = np.where(p <= n, np.int8(ROLE_A), np.int8(ROLE_PAD))
    role[p == n + 1] = ROLE_SEP
    role[:, 0] = ROLE_CLS
    src = np.where(role == ROLE_A, np.asarray(starts, dtype=np.int64)[:, None] + (p - 1), 0)
    return RowLayout(role, src)


def pair_rows(
    a_starts: ArrayLike,
    a_lengths: ArrayLike,
    b_starts: ArrayLike,
    b_lengths: ArrayLike,
    width: int,
) -> RowLayout:
    """[CLS] a [SEP] b [SEP] [PAD]...: truncated longest-first to width-3 content tokens."""
    m = width - 3
    la = np.asarray(a_lengths, dtype=np.int64)
    lb = np.asarray(b_lengths, dtype=np.int64)
    over = la + lb > m
    # Longest-first: trim the longer one until the pair fits; ties trim b.
    la_cut = np.minimum(la, np.maximum((m + 1) // 2, m - lb))
    la = np.where(over, la_cut, la)[:, None]
    lb = np.where(over, m - la[:, 0], lb)[:, None]
    p = np.arange(width)
    role = np.where(p <= la, np.int8(ROLE_A), np.int8(ROLE_PAD))
    role[p == la + 1] = ROLE_SEP
    role[(p >= la + 2) & (p <= la + lb + 1)] = ROLE_B
    role[p == la + lb + 2] = ROLE_SEP_B
    role[:, 0] = ROLE_CLS
    a_src = np.asarray(a_starts, dtype=np.int64)[:, None] + (p - 1)
    b_src = np.asarray(b_starts, dtype=np.int64)[:, None] + (p - 2) - la
    src = np.where(role == ROLE_A, a_src, np.where(role == ROLE_B, b_src, 0))
    return RowLayout(role, src)
