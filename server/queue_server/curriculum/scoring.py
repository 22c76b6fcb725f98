"""Scoring a composer's candidate batches: numpy over every batch at once, no loop over them.

The score of batch b is the neglect score of docs/curriculum.md, with the common factor N + 1
left out (N = tokens served so far):

    score(b) = sum over tokens t of b: count_b(t) * target(t) * g(t),
    g(t) = 1 / (served(t) + 1e-9 * (N + 1)),  target = (1 - alpha) * corpus + alpha / V.

**Exact scores** are computed row by row in a fixed order (np.add.reduceat over the row's own
entries), so a batch's score depends on its histogram, `served` and alpha only: not on which
other batches sit beside it, nor on which composer holds it. That is what lets several
composers split the buffer (`composer_workers`) and still pick what one composer picks.

Every score is made of four sums per batch: Z_A = count * corpus and Z_U = count over the
tokens not served yet (their g is the one factor 1/eps), S_A = count * corpus * g and
S_U = count * g over the served ones; score = (1 - alpha) * (Z_A / eps + S_A)
+ alpha * (Z_U / eps + S_U) / V. Serving only adds to served(t) and N, so scores only fall,
and a pick needs the exact score of few batches: those whose upper bound reaches the best
exact score found. The tokens split once by the corpus (not by the buffer, for the reason
above) into:

- head: the `HEAD_TOKENS` tokens of highest corpus probability (file_rows.py: TokenClasses).
  Nearly every batch holds them and every pick moves their g, so each pick bounds their part of every score at once:
  float32 counts (exact) times float32 weights rounded up, in blocks of _HEAD_BLOCK columns,
  each block widened by the worst rounding of its sum (gamma_n): a rigorous bound;
- tail: every other token. Each batch's four tail sums are kept from its last exact score;
  they bound the current ones from above. The rare tail tokens (from corpus rank RARE_FROM
  on) move the most when served and sit in few batches, so after each pick an index by token
  takes from the kept sums of the batches holding the pick's rare tokens what serving them
  certainly took (Pool.tighten).

A pick scores exactly the batches of the highest bounds, in growing rounds, until no bound
left reaches the best exact score: the batch a full exact rescoring would pick (the oldest on
a tie), after a few exact batches per pick. The bounds decide only how much is scored, never
what is picked.
"""

from __future__ import annotations

import itertools

import numpy as np

from queue_server.curriculum.file_rows import TokenClasses
from queue_server.curriculum.pool import Pool, concat_ranges

_EPS = 1e-9
_U32 = 2.0**-24  # float32 unit roundoff
# Head columns per float32 product: the rounding allowance of a product grows with its length.
_HEAD_BLOCK = 512
# Rounding allowance on kept tail sums: relative to the sums when last computed exactly
# (they shrink afterwards). Pool.tighten's own allowance is in pool.py.
_KEPT_SLACK = 1e-11
_FIRST_CHUNK = 2  # exact rows in the first round of a pick; each next round doubles it
_BLOCK = 1 << 16  # entries scored at once by exact()


class Weights:
    """Per-token factors for one state of `served` and one alpha, shared by every row."""

    def __init__(
        self,
        corpus: np.ndarray,
        classes: TokenClasses,
        served: np.ndarray,
        served_tokens: int,
        alpha: float,
    ) -> None:
        vocab = len(corpus)
        self.alpha = alpha
        self.vocab = vocab
        eps = _EPS * (served_tokens + 1)
        self.inv_eps = 1.0 / eps
        g = 1.0 / (served + eps)
        unseen = served == 0
        self.unseen = unseen.astype(np.float64)  # 1 for a token not served yet, else 0
        self.g_seen = np.where(unseen, 0.0, g)  # g of a served token, else 0
        head = classes.head
        w_head = ((1.0 - alpha) * corpus[head] + alpha / vocab) * g[head]
        w32 = w_head.astype(np.float32)
        low = w32.astype(np.float64) < w_head
        w32[low] = np.nextafter(w32[low], np.float32(np.inf))
        self.w32 = w32  # w on the head, in column order, rounded up to float32

    def tail_value(self, parts: np.ndarray) -> np.ndarray:
        """The score, or its tail part, from the four sums (4 x n)."""
        za, zu, sa, su = parts
        a = self.alpha
        return (1.0 - a) * (za * self.inv_eps + sa) + a * (zu * self.inv_eps + su) / self.vocab


def head_bounds(pool: Pool, weights: Weights) -> np.ndarray:
    """An upper bound of every row's head part: float32 counts @ rounded-up float32 weights,
    one product per block of _HEAD_BLOCK columns, each widened by the worst rounding of a
    float32 dot product of that many nonnegative terms (in any order of summation), summed
    in float64. numpy's matrix-vector product: a third of torch.mv's time on column blocks
    (workers load OpenBLAS with one thread: forkserver_preload.py)."""
    width = pool.head32.shape[1]
    if width == 0 or pool.n == 0:
        return np.zeros(pool.n)
    matrix = pool.head32[: pool.n]
    total = np.zeros(pool.n)
    for lo in range(0, width, _HEAD_BLOCK):
        hi = min(lo + _HEAD_BLOCK, width)
        gamma = (hi - lo) * _U32 / (1.0 - (hi - lo) * _U32)
        part = matrix[:, lo:hi] @ weights.w32[lo:hi]
        total += part.astype(np.float64) * (1.0 + 2.0 * gamma)
    return total * (1.0 + 1e-15) + 1e-30


def _sums(
    tok: np.ndarray,
    cnt: np.ndarray,
    ca: np.ndarray,
    head_len: np.ndarray,
    tail_len: np.ndarray,
    weights: Weights,
) -> np.ndarray:
    """The four sums (4 x 2k: head, tail, head, tail, ...) of k rows whose entries are given
    back to back: count * corpus and count over the tokens not served yet, count * corpus * g
    and count * g over the others. Each is summed over exactly its segment's entries, in a
    fixed order, so a row's sums are the same bits wherever the row stands."""
    products = np.empty((4, len(tok) + 1))  # a spare last column: a dummy segment's start
    products[:, -1] = 0.0
    unseen, g = weights.unseen[tok], weights.g_seen[tok]
    np.multiply(ca, unseen, out=products[0, :-1])
    np.multiply(cnt, unseen, out=products[1, :-1])
    np.multiply(ca, g, out=products[2, :-1])
    np.multiply(cnt, g, out=products[3, :-1])
    lens = np.empty(2 * len(head_len), np.int64)
    lens[0::2], lens[1::2] = head_len, tail_len
    starts = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    sums = np.add.reduceat(products, starts, axis=1)[:, :-1]
    sums[:, lens == 0] = 0.0
    return sums


def exact(pool: Pool, weights: Weights, rows: np.ndarray | None = None) -> np.ndarray:
    """Exact scores of `rows` (every row when None); their tail sums are kept, fresh.

    Per row, the four sums (_sums) over its head entries and over its tail entries; the
    score mixes their totals. A batch none of whose tokens was served scores
    count * target / eps to the last bit, so such batches of equal size tie exactly, and the
    oldest is picked. Rows go in blocks of about _BLOCK entries, so that the temporaries
    stay in cache."""
    if rows is None:
        rows = np.arange(pool.n)
    lens = pool.head_len[rows] + pool.tail_len[rows]
    total = int(lens.sum())
    cuts = [0, len(rows)]
    if total > _BLOCK:
        inner = np.searchsorted(np.cumsum(lens), np.arange(_BLOCK, total, _BLOCK))
        cuts = [0, *inner.tolist(), len(rows)]
    sums = np.empty((4, 2 * len(rows)))
    for lo, hi in itertools.pairwise(cuts):
        block = rows[lo:hi]
        if len(block) == 0:
            continue
        first, last = int(block[0]), int(block[-1])
        if last - first == len(block) - 1 and bool(np.all(np.diff(block) == 1)):
            # consecutive rows: their entries are one slice
            at: slice | np.ndarray = slice(
                int(pool.start[first]), int(pool.start[last] + lens[hi - 1])
            )
        else:
            at = concat_ranges(pool.start[block], lens[lo:hi])
        sums[:, 2 * lo : 2 * hi] = _sums(
            pool.tok[at],
            pool.cnt[at],
            pool.ca[at],
            pool.head_len[block],
            pool.tail_len[block],
            weights,
        )
    tail = sums[:, 1::2]
    pool.parts[:, rows] = tail
    pool.slack[:, rows] = _KEPT_SLACK * np.stack(
        [tail[0], tail[1], tail[2] + tail[0], tail[3] + tail[1]]
    )
    return weights.tail_value(sums[:, 0::2] + tail)


def bounds(pool: Pool, weights: Weights) -> np.ndarray:
    """Every row's upper bound of its exact score: the head's, plus the kept tail sums'."""
    n = pool.n
    head = head_bounds(pool, weights)
    if pool.tail_entries == 0:  # every token is a head token (a small vocabulary)
        return head
    tail = weights.tail_value(pool.parts[:, :n] + pool.slack[:, :n])
    tail[np.isnan(pool.parts[0, :n])] = np.inf  # no sums kept yet: scored exactly first
    return head + tail


def best(pool: Pool, weights: Weights) -> tuple[float, int] | None:
    """(score, pool row) of the alive row of the highest exact score, the lowest row (the
    oldest) on a tie; None when no row is alive. The rows of the highest bounds are scored
    exactly, in growing rounds, until no bound left reaches the best exact score."""
    if pool.live == 0:
        return None
    bound = bounds(pool, weights)
    bound[~pool.alive[: pool.n]] = -np.inf
    top, top_row = -np.inf, -1
    chunk = _FIRST_CHUNK
    while True:
        if chunk < pool.n:
            rows = np.argpartition(-bound, chunk - 1)[:chunk]
        else:
            rows = np.arange(pool.n)
        rows = rows[bound[rows] > -np.inf]
        scores = exact(pool, weights, rows)
        m = float(scores.max())
        if m >= top:
            first = int(rows[scores == m].min())
            top_row = first if m > top else min(top_row, first)
            top = m
        bound[rows] = -np.inf
        if float(bound.max()) < top:
            return top, top_row
        chunk *= 2
