"""Cut a block of tokenized documents into fixed windows of T tokens.

Input: one flat int32 array with each document's ids followed by EOS, and the lengths.
Output: `Windows`, four [n, T] arrays. In every window:
  - segment_ids number the documents (or pieces of one) 1, 2, ... from the left; 0 is padding.
    A trainer builds its attention mask from them (same id and causal), so attention never
    crosses documents.
  - labels[t] is the token that follows input_ids[t] in the same document: the next-token
    target, already shifted. At a document's EOS it is IGNORE (-100), since the next document
    cannot be predicted from one it may not attend to. At the last position of a window whose
    document goes on in a later window it is that next token. Padding is IGNORE.
  - attention_mask is True on real tokens, False on padding.

Modes:
  - sequential: one continuous stream, windows cut every T tokens; no padding, no token
    dropped. The tail that does not fill a window is the `carry` for the next block.
  - bin: documents are kept whole where they fit: a document longer than T is cut into pieces
    of T from its start (each a window of its own) plus a shorter last piece; the shorter
    pieces are placed best-fit into windows, longest first within groups of PACK_GROUP, the
    rest padded. The windows are then shuffled, so window order does not follow length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

IGNORE = -100
PACKING_MODES = ("sequential", "bin")
# Bin packing sorts pieces by length this many at a time (see _best_fit).
PACK_GROUP = 64


@dataclass
class Windows:
    input_ids: np.ndarray  # [n, T] int32
    labels: np.ndarray  # [n, T] int32
    segment_ids: np.ndarray  # [n, T] int32
    attention_mask: np.ndarray | None  # [n, T] bool; None: all True (sequential)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def mask(self, lo: int, hi: int) -> np.ndarray:
        if self.attention_mask is None:
            return np.ones((hi - lo, self.input_ids.shape[1]), dtype=bool)
        return self.attention_mask[lo:hi]


def next_token_labels(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """labels[i] = tokens[i+1] within a document, IGNORE at each document's last token."""
    labels = np.empty_like(tokens)
    if len(tokens):
        labels[:-1] = tokens[1:]
        labels[np.cumsum(lengths) - 1] = IGNORE
    return labels


def pack_sequential(
    tokens: np.ndarray, lengths: np.ndarray, seq_len: int
) -> tuple[Windows, np.ndarray, np.ndarray]:
    """Windows of the stream `tokens`, plus the carry (tokens, lengths) that fills none."""
    n = len(tokens) // seq_len
    used = n * seq_len
    labels = next_token_labels(tokens, lengths)
    seg = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)[:used].reshape(
        n, seq_len
    )
    seg -= seg[:, :1].copy() - 1  # number documents from 1 in each window
    windows = Windows(
        tokens[:used].reshape(n, seq_len), labels[:used].reshape(n, seq_len), seg, None
    )
    ends = np.cumsum(lengths)
    j = int(np.searchsorted(ends, used, side="right"))
    if used == len(tokens):
        carry_lengths = np.zeros(0, dtype=np.int64)
    else:
        carry_lengths = np.concatenate([[ends[j] - used], lengths[j + 1 :]]).astype(np.int64)
    return windows, tokens[used:].copy(), carry_lengths


def _best_fit(lengths: np.ndarray, seq_len: int, group: int = PACK_GROUP) -> np.ndarray:
    """The bin of each piece, bins numbered in the order they open. Pieces are taken `group`
    at a time in block order, longest first within a group, each into the fullest open bin it
    fits (best fit; ties: the bin opened first); all bins stay open.

    Sorting only within groups keeps nearly all of best-fit-decreasing's density while the
    bins' make-up follows the shuffled order, so a new epoch brings new windows, not the same
    ones reordered. Each placement depends on all the ones before it, so this is the one loop
    of packing: once per document piece, never per token or per window.
    """
    sizes = lengths.tolist()
    bin_of = [0] * len(sizes)
    opened = 0
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in _group_order(lengths, group).tolist():
        size = sizes[i]
        k = bisect.bisect_left(free, (size, -1))
        if k < len(free):
            room, b = free.pop(k)
            room -= size
        else:
            b, room = opened, seq_len - size
            opened += 1
        if room > 0:
            bisect.insort(free, (room, b))
        bin_of[i] = b
    return np.asarray(bin_of, dtype=np.int64)


def _group_order(lengths: np.ndarray, group: int) -> np.ndarray:
    """Indices in block order, `group` at a time, longest first (stable) within each group."""
    return np.lexsort((-lengths, np.arange(len(lengths)) // group))


def pack_bin(
    tokens: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    *,
    pad_id: int,
    rng: np.random.Generator | None,
) -> Windows:
    """Whole documents best-fit into windows, long ones split; windows shuffled by `rng`."""
    labels = next_token_labels(tokens, lengths)
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    full = lengths // seq_len
    rest = lengths - full * seq_len
    # Full-length pieces: one window each, first.
    full_starts = np.repeat(starts, full) + seq_len * _ranks(full)
    # The shorter last pieces, best-fit into the windows after those.
    has_rest = rest > 0
    bin_of = _best_fit(rest[has_rest], seq_len)
    n_full = len(full_starts)
    n_windows = n_full + (int(bin_of.max()) + 1 if len(bin_of) else 0)
    src = np.concatenate([full_starts, (starts + full * seq_len)[has_rest]])
    size = np.concatenate([np.full(n_full, seq_len, dtype=np.int64), rest[has_rest]])
    window = np.concatenate([np.arange(n_full, dtype=np.int64), n_full + bin_of])
    if rng is not None:
        # Window j goes to the place where the permutation names it.
        place = np.empty(n_windows, dtype=np.int64)
        place[rng.permutation(n_windows)] = np.arange(n_windows)
        window = place[window]
    order = np.lexsort((src, window))  # by window, and in block order inside a window
    return _fill(tokens, labels, window[order], src[order], size[order], n_windows, seq_len, pad_id)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """For counts [2, 0, 3]: [0, 1, 0, 1, 2], the index of each repeat within its group."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    group_start = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - group_start


def _fill(
    tokens: np.ndarray,
    labels: np.ndarray,
    window: np.ndarray,
    src: np.ndarray,
    size: np.ndarray,
    n_windows: int,
    seq_len: int,
    pad_id: int,
) -> Windows:
    """Windows holding the pieces (src, size), which come sorted by window and then by their
    place inside it: each piece right after the one before it, numbered from 1, then padding."""
    seg = _ranks(np.bincount(window, minlength=n_windows)).astype(np.int32) + 1
    before = np.cumsum(size) - size  # where each piece starts in all windows' content
    window_first = np.maximum.accumulate(np.where(seg == 1, before, 0)) if len(seg) else before
    within = _ranks(size)
    src_idx = np.repeat(src, size) + within
    dst_idx = np.repeat(window * seq_len + before - window_first, size) + within
    input_ids = np.full(n_windows * seq_len, pad_id, dtype=np.int32)
    out_labels = np.full(n_windows * seq_len, IGNORE, dtype=np.int32)
    segment_ids = np.zeros(n_windows * seq_len, dtype=np.int32)
    mask = np.zeros(n_windows * seq_len, dtype=bool)
    input_ids[dst_idx] = tokens[src_idx]
    out_labels[dst_idx] = labels[src_idx]
    segment_ids[dst_idx] = np.repeat(seg, size)
    mask[dst_idx] = True
    shape = (n_windows, seq_len)
    return Windows(
        input_ids.reshape(shape),
        out_labels.reshape(shape),
        segment_ids.reshape(shape),
        mask.reshape(shape),
    )
