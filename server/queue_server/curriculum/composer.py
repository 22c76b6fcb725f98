"""The composer: a buffer of candidate batches, and the rule that picks each served batch.

Each served file (seq s, K batches) is composed in seq order:

1. ingest: the next candidate files (`files_per_plan` of them; the first file also fills the
   buffer to `capacity`) join the buffer, every batch with its sparse token histogram;
2. pick, K times: score every buffered batch by the neglect score of the design,
   sum over its tokens t of count(t) * target(t) / (served(t) + 1e-9), where
   target = (1 - alpha) * corpus + alpha * uniform and served is the distribution of the
   tokens served so far; serve the best (the oldest on a tie) and add its tokens to served.
   Scores only fall as tokens are served, so a pick rescores lazily (see _Parts);
3. cull: a batch that waited `max_age` files is dropped, and so are the lowest scorers beyond
   `capacity`; a candidate file none of whose batches is left is retired (deleted).

Everything is a pure function of the candidates (deterministic per candidate seq), the alpha
overrides and the world size, so the same calls give the same batches. Scoring is numpy over
the buffer's histograms (a full pass per served file, a few batches per pick) and runs in a
worker process, never on the server's event loop; a change of alpha is used by the next pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from queue_client.batchfile import BatchFile, PublishedFile, load_batch_file, write_batch_file
from queue_client.layout import atomic_write
from queue_server.curriculum.corpus import kl_divergence
from queue_server.curriculum.schedule import alpha_for
from queue_server.curriculum.settings import ComposerSettings

_EPS = 1e-9
# Columns of the dense part of the scores (see _Parts): 1000 batches x 4096 float64 = 32 MB.
_MAX_DENSE = 4096
SNAPSHOT_VERSION = 1
# The composer's integer state, in snapshot order after the version.
_SNAPSHOT_COUNTERS = ("served_tokens", "next_candidate", "plans", "ingested", "culled", "picked")


@dataclass
class CandidateFile:
    batches: BatchFile
    offsets: np.ndarray
    ids: np.ndarray
    counts: np.ndarray

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> CandidateFile:
        bf = load_batch_file(path)
        try:
            offsets = bf.extras["token_hist_offsets"].numpy()
            ids = bf.extras["token_hist_ids"].numpy().astype(np.int64)
            counts = bf.extras["token_hist_counts"].numpy().astype(np.float64)
        except KeyError:
            raise ValueError(f"{path}: candidate file has no token histograms") from None
        if len(offsets) != bf.metadata["num_batches"] + 1 or (ids.size and ids.max() >= vocab_size):
            raise ValueError(f"{path}: token histograms do not fit {vocab_size} ids")
        return cls(bf, offsets, ids, counts)

    def hist(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.ids[lo:hi], self.counts[lo:hi]


class _Parts:
    """Every buffered batch's score, kept so that a pick costs far less than a rescoring:

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

    def __init__(self, composer: Composer, hists: list[tuple[np.ndarray, np.ndarray]]) -> None:
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
class Composition:
    picks: list[tuple[int, int]]
    alphas: list[float]
    retired: list[int]
    culled: int


class Composer:
    def __init__(self, settings: ComposerSettings, corpus: np.ndarray) -> None:
        if corpus.shape != (settings.vocab_size,):
            raise ValueError(
                f"corpus distribution has shape {corpus.shape}, expected ({settings.vocab_size},)"
            )
        self.settings = settings
        self.corpus = corpus.astype(np.float64)
        self.served = np.zeros(settings.vocab_size, np.int64)
        self.served_tokens = 0
        # The buffer, in ingest order: candidate seq, batch index in it, served seq it came in at.
        self.cand = np.zeros(0, np.int64)
        self.index = np.zeros(0, np.int64)
        self.born = np.zeros(0, np.int64)
        self.next_candidate = 0
        self.plans = 0
        self.ingested = self.culled = self.picked = 0
        self.alpha = settings.schedule.alpha
        self._files: dict[int, CandidateFile] = {}

    # ---- what the lane needs to know ---------------------------------------------------
    def needed(self) -> list[int]:
        """Candidate seqs the next served file ingests."""
        s = self.settings
        n = s.files_per_plan + (s.initial_files if self.plans == 0 else 0)
        return list(range(self.next_candidate, self.next_candidate + n))

    def held(self) -> list[int]:
        """Candidate seqs with a batch still in the buffer: their files must stay on disk."""
        return sorted(set(self.cand.tolist()))

    def attach(self, paths: Mapping[int, str | Path]) -> None:
        """Map the candidate files at `paths` that are not mapped yet."""
        for c, path in paths.items():
            if int(c) not in self._files:
                self._files[int(c)] = CandidateFile.load(Path(path), self.settings.vocab_size)

    def detach_unheld(self) -> None:
        keep = set(self.cand.tolist())
        for c in [c for c in self._files if c not in keep]:
            del self._files[c]

    def target(self, alpha: float) -> np.ndarray:
        return (1.0 - alpha) * self.corpus + alpha / self.settings.vocab_size

    def kl_to_target(self) -> float:
        return kl_divergence(self.served.astype(np.float64), self.target(self.alpha))

    def buffered_histograms(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The token histogram (ids, counts) of every batch in the buffer, in buffer order:
        what a full rescoring of the buffer reads (bench row 8 times one beside a pick)."""
        return [self._file(int(c)).hist(int(i)) for c, i in zip(self.cand, self.index, strict=True)]

    # ---- composing -----------------------------------------------------------------------
    def compose(self, seq: int, world_size: int, overrides: Sequence[Sequence]) -> Composition:
        if seq != self.plans:
            raise ValueError(f"served seq {seq} composed out of order: the next is {self.plans}")
        s = self.settings
        for c in self.needed():
            nb = int(self._file(c).batches.metadata["num_batches"])
            self.cand = np.concatenate([self.cand, np.full(nb, c, np.int64)])
            self.index = np.concatenate([self.index, np.arange(nb, dtype=np.int64)])
            self.born = np.concatenate([self.born, np.full(nb, seq, np.int64)])
            self.ingested += nb
            self.next_candidate = c + 1
        n = len(self.cand)
        if n < s.batches_per_file:
            raise ValueError(
                f"the buffer holds {n} batches, fewer than one file's {s.batches_per_file}"
            )
        hists = [
            self._file(int(c)).hist(int(i)) for c, i in zip(self.cand, self.index, strict=True)
        ]
        parts = _Parts(self, hists)
        alive = np.ones(n, bool)
        picks: list[tuple[int, int]] = []
        alphas: list[float] = []
        for i in range(s.batches_per_file):
            alpha = alpha_for(
                s.schedule, overrides, seq, i, s.batches_per_file, world_size, self.served_tokens
            )
            best = parts.best(alive, alpha)
            alive[best] = False
            b_ids, b_counts = hists[best]
            self.served[b_ids] += b_counts.astype(np.int64)
            self.served_tokens += int(b_counts.sum())
            parts.served_changed()
            picks.append((int(self.cand[best]), int(self.index[best])))
            alphas.append(alpha)
        self.alpha = alphas[-1]
        self.picked += len(picks)
        culled = self._cull(alive, parts, seq)
        before = set(self.cand.tolist())
        self.cand, self.index, self.born = self.cand[alive], self.index[alive], self.born[alive]
        retired = sorted(before - set(self.cand.tolist()))
        self.plans += 1
        return Composition(picks, alphas, retired, culled)

    def _cull(self, alive: np.ndarray, parts: _Parts, seq: int) -> int:
        s = self.settings
        old = alive & (self.born <= seq - s.max_age)
        culled = int(old.sum())
        alive &= ~old
        over = int(alive.sum()) - s.capacity
        if over > 0:
            scores = parts.exact_scores(alive, self.alpha)
            keep = np.argsort(-scores, kind="stable")[: s.capacity]
            alive[:] = False
            alive[keep] = True
            culled += over
        self.culled += culled
        return culled

    def _file(self, c: int) -> CandidateFile:
        try:
            return self._files[c]
        except KeyError:
            raise ValueError(f"candidate seq {c} is needed but was not attached") from None

    # ---- served files ----------------------------------------------------------------------
    def write(
        self,
        directory: Path,
        seq: int,
        picks: Sequence[Sequence[int]],
        alphas: Sequence[float],
    ) -> PublishedFile:
        """Publish served file `seq`: the picked batches copied out of their candidate files."""
        import torch  # here, not at import: the server process itself never loads torch

        first = self._file(int(picks[0][0])).batches
        names = [f["name"] for f in first.metadata["schema"]]
        tensors = {
            name: torch.stack([self._file(int(c)).batches.tensors[name][int(i)] for c, i in picks])
            for name in names
        }
        metadata = {
            key: first.metadata[key] for key in ("dataset", "split", "batch_size", "schema")
        }
        metadata["curriculum_alphas"] = [round(a, 6) for a in alphas]
        return write_batch_file(directory, seq=seq, tensors=tensors, metadata=metadata)

    # ---- snapshots -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        scalars = np.array(
            [SNAPSHOT_VERSION, *(getattr(self, name) for name in _SNAPSHOT_COUNTERS)], np.int64
        )
        arrays = {
            "scalars": scalars,
            "alpha": np.array([self.alpha]),
            "served": self.served,
            "cand": self.cand,
            "index": self.index,
            "born": self.born,
        }
        atomic_write(path, lambda f: np.savez(f, **arrays))

    def restore(self, path: Path) -> None:
        with np.load(path, allow_pickle=False) as z:
            scalars = z["scalars"]
            if int(scalars[0]) != SNAPSHOT_VERSION:
                raise ValueError(f"{path}: composer snapshot version {int(scalars[0])} is unknown")
            if z["served"].shape != self.served.shape:
                raise ValueError(f"{path}: composer snapshot is for another vocab size")
            for name, value in zip(_SNAPSHOT_COUNTERS, scalars[1:], strict=True):
                setattr(self, name, int(value))
            self.alpha = float(z["alpha"][0])
            self.served = z["served"].astype(np.int64)
            self.cand, self.index, self.born = z["cand"], z["index"], z["born"]
        self._files.clear()

    def stats(self) -> dict:
        return {
            "alpha": self.alpha,
            "kl_to_target": self.kl_to_target(),
            "buffer_batches": len(self.cand),
            "served_tokens": self.served_tokens,
            "candidates_ingested": self.ingested,
            "candidates_culled": self.culled,
            "next_candidate": self.next_candidate,
        }
