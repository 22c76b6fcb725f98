"""The vectorised scoring (queue_server/curriculum/scoring.py) against the scoring it
replaced, on many random buffers: the same pick, or a pick whose score equals the
reference's but for rounding in the last bits (the two sum in different orders, so where
scores tie to the last bits each breaks the tie by its own rounding). Exact scores are a
function of the batch alone, the kept bounds never fall below them, and exact ties go to the
oldest batch."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_server.curriculum.candidate_files import CandidateFile
from queue_server.curriculum.file_rows import FileRows, TokenClasses
from queue_server.curriculum.pool import Pool
from queue_server.curriculum.scoring import Weights, best, bounds, exact

_EPS = 1e-9
# Columns of the dense part of the scores (see ReferenceParts).
_MAX_DENSE = 4096


@dataclass
class _Settings:
    vocab_size: int


class ReferenceState:
    """What ReferenceParts reads of its composer."""

    def __init__(self, corpus: np.ndarray, served: np.ndarray) -> None:
        self.corpus = corpus
        self.served = served
        self.served_tokens = int(served.sum())
        self.settings = _Settings(len(corpus))

    def target(self, alpha: float) -> np.ndarray:
        return (1.0 - alpha) * self.corpus + alpha / self.settings.vocab_size


class ReferenceParts:
    """The composer's scoring before it was vectorised (a Python loop over batches), kept
    here as the reference the vectorised picks are checked against. Every buffered batch's
    score, kept so that a pick costs far less than a rescoring:

        score(b) = sum_t count_b(t) * target(t) * g(t),
        g(t) = 1 / (served(t) + 1e-9 * (N + 1)),      N = tokens served so far,

    which ranks batches exactly as the design's neglect score, target(t) / (served(t) / (N+1)
    + 1e-9), does (the two differ by the factor N + 1, common to all). Three parts:

    - dense: tokens most batches hold (in at least an eighth of the buffer, at most
      _MAX_DENSE of them) carry most of every score and move after every pick: a
      matrix-vector product per pick;
    - unseen: every other token not served yet has the same g = 1 / (1e-9 * (N + 1)), so
      per batch the sums Z_A = count * corpus and Z_U = count / V times that one factor;
    - seen: the other served tokens, per batch A = count * corpus * g and U = count * g / V.

    Alpha mixes the parts for free: (1 - alpha) * (A-like) + alpha * (U-like). Serving only
    adds to served(t) and N, and moving a token from unseen to seen only lowers its g, so
    stale unseen and seen parts bound the exact ones from above: each pick recomputes only
    the batches that reach the top (lazy greedy) and takes the first whose bound is exact,
    the batch a full rescoring would pick.
    """

    def __init__(
        self, composer: ReferenceState, hists: list[tuple[np.ndarray, np.ndarray]]
    ) -> None:
        self.c = composer
        self.hists = hists
        n, vocab = len(hists), composer.settings.vocab_size
        df = np.bincount(np.concatenate([h[0] for h in hists]), minlength=vocab)
        dense = np.flatnonzero(df >= max(2, n // 8))
        if len(dense) > _MAX_DENSE:  # the most widespread ones, ties to the lower id
            dense = np.sort(np.argsort(-df, kind="stable")[:_MAX_DENSE])
        column = np.full(vocab, -1, np.int64)
        column[dense] = np.arange(len(dense))
        self.dense = dense
        self.dense_counts = np.zeros((n, len(dense)))
        self.sparse: list[tuple[np.ndarray, np.ndarray]] = []
        for i, (ids, counts) in enumerate(hists):
            cols = column[ids]
            in_dense = cols >= 0
            self.dense_counts[i, cols[in_dense]] = counts[in_dense]
            self.sparse.append((ids[~in_dense], counts[~in_dense]))
        self.parts = np.empty((4, n))  # rows: unseen Z_A, Z_U; seen A, U
        for i in range(n):
            self._exact(i)
        self.fresh = np.ones(n, bool)

    def _eps(self) -> float:
        return _EPS * (self.c.served_tokens + 1)

    def _exact(self, i: int) -> None:
        c = self.c
        ids, counts = self.sparse[i]
        served = c.served[ids]
        unseen = served == 0
        vocab = c.settings.vocab_size
        self.parts[0, i] = float(counts[unseen] @ c.corpus[ids[unseen]])
        self.parts[1, i] = float(counts[unseen].sum()) / vocab
        seen = ~unseen
        g = 1.0 / (served[seen] + self._eps())
        self.parts[2, i] = float(counts[seen] @ (c.corpus[ids[seen]] * g))
        self.parts[3, i] = float(counts[seen] @ g) / vocab

    def served_changed(self) -> None:
        self.fresh[:] = False

    def _mix(self, alpha: float) -> np.ndarray:
        """The per-part factors of the current alpha and N."""
        unseen = 1.0 / self._eps()
        return np.array([(1.0 - alpha) * unseen, alpha * unseen, 1.0 - alpha, alpha])

    def _dense_part(self, alpha: float) -> np.ndarray:
        g = 1.0 / (self.c.served[self.dense] + self._eps())
        return self.dense_counts @ (self.c.target(alpha)[self.dense] * g)

    def best(self, alive: np.ndarray, alpha: float) -> int:
        """The alive batch of the highest score, the first (oldest) on a tie."""
        dense, mix = self._dense_part(alpha), self._mix(alpha)
        bound = dense + mix @ self.parts
        bound[~alive] = -np.inf
        while True:
            i = int(np.argmax(bound))
            if self.fresh[i]:
                return i
            self._exact(i)
            self.fresh[i] = True
            bound[i] = dense[i] + mix @ self.parts[:, i]

    def exact_scores(self, alive: np.ndarray, alpha: float) -> np.ndarray:
        for i in np.flatnonzero(alive & ~self.fresh):
            self._exact(int(i))
            self.fresh[i] = True
        scores = self._dense_part(alpha) + self._mix(alpha) @ self.parts
        scores[~alive] = -np.inf
        return scores


@dataclass
class Buffer:
    corpus: np.ndarray
    served: np.ndarray
    hists: list[tuple[np.ndarray, np.ndarray]]
    alpha: float
    classes: TokenClasses

    def pool(self) -> Pool:
        offsets = np.cumsum([0] + [len(h[0]) for h in self.hists])
        ids = np.concatenate([h[0] for h in self.hists]).astype(np.int64)
        counts = np.concatenate([h[1] for h in self.hists]).astype(np.float64)
        cf = CandidateFile(None, offsets, ids, counts)  # type: ignore[arg-type]
        pool = Pool(self.classes.width, len(self.corpus))
        pool.add(FileRows.build(cf, self.classes, self.corpus), np.arange(len(self.hists)))
        pool.index()
        return pool

    def weights(self) -> Weights:
        n = int(self.served.sum())
        return Weights(self.corpus, self.classes, self.served, n, self.alpha)

    def precise(self) -> np.ndarray:
        """Every batch's score in extended precision, the common factor N + 1 left out."""
        ld = np.longdouble
        eps = ld(_EPS) * (int(self.served.sum()) + 1)
        a = ld(self.alpha)
        out = []
        for ids, counts in self.hists:
            target = (1 - a) * self.corpus[ids].astype(ld) + a / len(self.corpus)
            g = 1 / (self.served[ids].astype(ld) + eps)
            out.append(np.sum(counts.astype(ld) * target * g))
        return np.array(out)


@st.composite
def buffers(draw: st.DrawFn) -> Buffer:
    seed = draw(st.integers(0, 2**32 - 1))
    vocab = draw(st.integers(2, 300))
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab + 1) ** draw(st.floats(0.0, 1.6))
    weights = rng.permutation(weights)
    corpus = weights / weights.sum()
    if draw(st.booleans()):  # tokens the corpus sample never saw
        corpus[rng.random(vocab) < 0.2] = 0.0
        corpus = corpus / corpus.sum() if corpus.sum() > 0 else np.full(vocab, 1.0 / vocab)
    size = draw(st.integers(1, 200))
    hists = []
    for _ in range(n):
        if hists and rng.random() < 0.2:  # a duplicate of an earlier batch
            hists.append(hists[int(rng.integers(len(hists)))])
            continue
        tokens = rng.choice(vocab, size=size, p=weights / weights.sum())
        ids, counts = np.unique(tokens, return_counts=True)
        hists.append((ids.astype(np.int64), counts.astype(np.float64)))
    served = np.zeros(vocab, np.int64)
    if draw(st.booleans()):
        served = rng.integers(0, draw(st.integers(1, 50)), vocab) * (rng.random(vocab) < 0.7)
    alpha = draw(st.sampled_from([0.0, 1.0, 0.5, 0.25, float(rng.random())]))
    classes = TokenClasses.of(corpus, draw(st.integers(0, vocab)), draw(st.integers(0, vocab)))
    return Buffer(corpus, served.astype(np.int64), hists, alpha, classes)


def reference_pick(buf: Buffer, alive: np.ndarray) -> int:
    return ReferenceParts(ReferenceState(buf.corpus, buf.served), buf.hists).best(alive, buf.alpha)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers(), st.data())
def test_picks_match_the_reference_scoring(buf: Buffer, data: st.DataObject) -> None:
    pool = buf.pool()
    dead = data.draw(st.lists(st.integers(0, len(buf.hists) - 1), max_size=len(buf.hists) - 1))
    pool.kill(np.unique(np.array(dead, np.int64)))
    alive = pool.alive[: pool.n].copy()
    found = best(pool, buf.weights())
    assert found is not None
    score, row = found
    want = reference_pick(buf, alive)
    precise = buf.precise()
    top = precise[alive].max()
    assert alive[row]
    if row != want:  # a tie to the last bits, broken by each side's own rounding
        assert abs(precise[row] - precise[want]) <= 1e-12 * top, (row, want)
    assert precise[row] >= top * (1 - 1e-12)
    assert abs(score - float(precise[row])) <= 1e-12 * float(top)


def test_without_ties_the_picks_are_the_reference_picks() -> None:
    """On buffers without ties the two scorings pick the same batches, through runs of picks
    (each serving its batch, the kept sums tightened after each)."""
    rng = np.random.default_rng(3)
    vocab, same, total = 64, 0, 0
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    corpus = p / p.sum()
    for trial in range(20):
        hists = []
        for _ in range(30):
            ids, counts = np.unique(rng.choice(vocab, size=97, p=corpus), return_counts=True)
            hists.append((ids.astype(np.int64), counts.astype(np.float64)))
        served = rng.integers(1, 40, vocab).astype(np.int64)  # no all-unseen ties
        buf = Buffer(corpus, served, hists, trial / 19, TokenClasses.of(corpus, 16, 40))
        pool = buf.pool()
        for _ in range(10):
            alive = pool.alive[: pool.n].copy()
            _, row = best(pool, buf.weights())
            total += 1
            same += row == reference_pick(buf, alive)
            ids, counts = hists[row]
            pool.tighten(ids, counts, served, *_eps_around(served, counts), buf.classes.rare)
            served[ids] += counts.astype(np.int64)
            pool.kill(np.array([row]))
    assert same == total


def _eps_around(served: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    n = int(served.sum())
    return _EPS * (n + 1), _EPS * (n + int(counts.sum()) + 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers(), st.integers(1, 12))
def test_kept_bounds_never_fall_below_exact_scores(buf: Buffer, picks: int) -> None:
    """Through a run of picks, with the tail sums tightened after each, every alive batch's
    bound stays at or above its exact score."""
    pool = buf.pool()
    served = buf.served
    for _ in range(min(picks, len(buf.hists))):
        weights = buf.weights()
        alive = np.flatnonzero(pool.alive[: pool.n])
        limit = bounds(pool, weights)[alive]
        scores = exact(copy.deepcopy(pool), weights, alive)  # kept sums left as they are
        assert np.all(limit >= scores)
        _, row = best(pool, weights)
        ids, counts = buf.hists[row]
        pool.tighten(ids, counts, served, *_eps_around(served, counts), buf.classes.rare)
        served[ids] += counts.astype(np.int64)
        pool.kill(np.array([row]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers(), st.integers(0, 2**32 - 1))
def test_an_exact_score_is_a_function_of_the_batch_alone(buf: Buffer, seed: int) -> None:
    """The same batch scores the same bits alone, in the whole buffer, or in a shuffled
    buffer: what lets composers split the buffer and pick what one composer picks."""
    weights = buf.weights()
    everyone = exact(buf.pool(), weights)
    order = np.random.default_rng(seed).permutation(len(buf.hists))
    shuffled = Buffer(buf.corpus, buf.served, [buf.hists[i] for i in order], 0.0, buf.classes)
    assert np.array_equal(exact(shuffled.pool(), weights)[np.argsort(order)], everyone)
    for i in range(min(len(buf.hists), 5)):
        alone = Buffer(buf.corpus, buf.served, [buf.hists[i]], 0.0, buf.classes)
        assert exact(alone.pool(), weights)[0] == everyone[i]


def test_exact_ties_go_to_the_oldest_batch() -> None:
    """Nothing served yet and alpha 1: every batch of the same size scores the same, to the
    last bit, and the oldest is picked (the reference broke this tie by rounding)."""
    rng = np.random.default_rng(0)
    vocab = 1000
    corpus = np.full(vocab, 1.0 / vocab)
    hists = []
    for _ in range(50):
        ids, counts = np.unique(rng.integers(0, vocab, 512), return_counts=True)
        hists.append((ids.astype(np.int64), counts.astype(np.float64)))
    served = np.zeros(vocab, np.int64)
    buf = Buffer(corpus, served, hists, 1.0, TokenClasses.of(corpus, 100, 300))
    scores = exact(buf.pool(), buf.weights())
    assert len(set(scores.tolist())) == 1
    assert best(buf.pool(), buf.weights())[1] == 0
