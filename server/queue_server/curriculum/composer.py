"""The composer: a buffer of candidate batches, and the rule that picks each served batch.

Each served file (seq s, K batches) is composed in seq order:

1. ingest: the next candidate files (`files_per_plan` of them; the first file also fills the
   buffer to `capacity`) join the buffer, every batch with its sparse token histogram;
2. pick, K times: score every buffered batch by the neglect score of the design,
   sum over its tokens t of count(t) * target(t) / (served(t) + 1e-9), where
   target = (1 - alpha) * corpus + alpha * uniform and served is the distribution of the
   tokens served so far; serve the best (the oldest on a tie) and add its tokens to served.
   Scores only fall as tokens are served, so a pick scores exactly only the batches whose
   bound reaches the top (scoring.py);
3. cull: a batch that waited `max_age` files is dropped, and so are the lowest scorers beyond
   `capacity`; a candidate file none of whose batches is left is retired (deleted).

With `streams` S > 1 (streams.py) a Composer is one stream k: it composes the served seqs
k, k+S, ... from the candidate seqs k, k+S, ..., and the other streams are other Composers.

Everything is a pure function of the candidates (deterministic per candidate seq), the alpha
overrides and the world size, so the same calls give the same batches; and a batch's exact
score is a function of its own histogram and the served counts, so composers that split the
buffer between them (`composer_workers`) pick exactly what one composer picks. Scoring is
numpy and runs in composer processes, never on the server's event loop; a change of alpha is
used by the next pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from queue_client.format.batchfile import PublishedFile
from queue_server.curriculum.candidate_files import CandidateFile, write_served
from queue_server.curriculum.corpus import kl_divergence
from queue_server.curriculum.file_rows import FileRows, TokenClasses
from queue_server.curriculum.pool import Pool
from queue_server.curriculum.schedule import alpha_for
from queue_server.curriculum.scoring import Weights, best, exact
from queue_server.curriculum.settings import ComposerSettings
from queue_server.curriculum.shards import best_of, owned
from queue_server.curriculum.snapshot import restore_snapshot, save_snapshot

_EPS = 1e-9  # of g(t) = 1 / (served(t) + 1e-9 * (N + 1)), as in scoring.py


@dataclass
class Composition:
    picks: list[tuple[int, int]]
    alphas: list[float]
    retired: list[int]
    culled: int


@dataclass
class _Plan:
    """The served file being composed: its picks so far and which buffered batches are left."""

    seq: int
    world_size: int
    overrides: list
    alive: np.ndarray  # per buffer position
    row_of: np.ndarray  # per buffer position: its row in this composer's pool, or -1
    position_of: np.ndarray  # per pool row: its buffer position, or -1
    picks: list[tuple[int, int]] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    aged: int = 0  # culled by age
    over: int = 0  # batches beyond capacity after the age cull


class Composer:
    """The buffer and the pick rule. With `shards` > 1 several Composers (one per process) keep
    the same buffer, served counts and picks, and each scores its own part of the buffer
    (`owned`); a pick is the best of their proposals (`best_of`). One Composer composes alone
    with compose(); several are driven step by step: begin, then propose/accept per batch,
    then cull_scores and finish, each step on every composer."""

    def __init__(
        self,
        settings: ComposerSettings,
        corpus: np.ndarray,
        shard: int = 0,
        shards: int = 1,
        stream: int = 0,
    ) -> None:
        if corpus.shape != (settings.vocab_size,):
            raise ValueError(
                f"corpus distribution has shape {corpus.shape}, expected ({settings.vocab_size},)"
            )
        if not 0 <= shard < shards:
            raise ValueError(f"composer {shard} of {shards} does not exist")
        if not 0 <= stream < settings.streams:
            raise ValueError(f"curriculum stream {stream} of {settings.streams} does not exist")
        self.settings = settings
        self.shard, self.shards = shard, shards
        self.stream = stream
        self.corpus = corpus.astype(np.float64)
        self.classes = TokenClasses.of(self.corpus)
        self.served = np.zeros(settings.vocab_size, np.int64)
        self.served_tokens = 0
        # The buffer, in ingest order: candidate seq, batch index in it, served seq it came in at.
        # Served seqs and candidate seqs of this stream step by `streams`.
        self.cand = np.zeros(0, np.int64)
        self.index = np.zeros(0, np.int64)
        self.born = np.zeros(0, np.int64)
        self.next_candidate = stream
        self.plans = 0
        self.ingested = self.culled = self.picked = 0
        self.alpha = settings.schedule.alpha
        self._files: dict[int, CandidateFile] = {}
        self._rows: dict[int, FileRows] = {}
        self._pool: Pool | None = None  # the batches this composer scores (scoring.py)
        self._plan: _Plan | None = None
        self._dirty = False

    # ---- what the lane needs to know ---------------------------------------------------
    def needed(self) -> list[int]:
        """Candidate seqs the next served file ingests."""
        s = self.settings
        n = s.files_per_plan + (s.initial_files if self.plans == 0 else 0)
        return list(range(self.next_candidate, self.next_candidate + n * s.streams, s.streams))

    @property
    def next_seq(self) -> int:
        """The served seq this stream composes next."""
        return self.stream + self.plans * self.settings.streams

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
            self._rows.pop(c, None)

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
        """Compose served file `seq` alone (shards == 1)."""
        self.begin(seq, world_size, overrides)
        for _ in range(self.settings.batches_per_file):
            self.accept(best_of([self.propose()]))
        return self.finish(self.cull_scores())

    def begin(self, seq: int, world_size: int, overrides: Sequence[Sequence]) -> None:
        """Ingest the next candidate files and set up the scoring of served file `seq`."""
        if seq != self.next_seq:
            raise ValueError(f"served seq {seq} composed out of order: the next is {self.next_seq}")
        if self._dirty:
            raise ValueError(
                f"served seq {seq} was left half composed: this composer must restore its "
                "last snapshot"
            )
        s = self.settings
        needed = [(c, self._file(c)) for c in self.needed()]  # all attached, or nothing changes
        sizes = [int(f.batches.metadata["num_batches"]) for _, f in needed]
        n = len(self.cand) + sum(sizes)
        if n < s.batches_per_file:
            raise ValueError(
                f"the buffer holds {n} batches, fewer than one file's {s.batches_per_file}"
            )
        self._dirty = True  # until finish: a failure on the way leaves nothing to go on from
        for (c, _), nb in zip(needed, sizes, strict=True):
            self.cand = np.concatenate([self.cand, np.full(nb, c, np.int64)])
            self.index = np.concatenate([self.index, np.arange(nb, dtype=np.int64)])
            self.born = np.concatenate([self.born, np.full(nb, seq, np.int64)])
            self.ingested += nb
            self.next_candidate = c + s.streams
        mine = np.flatnonzero(
            owned(self.cand, self.index, s.candidate_batches_per_file, self.shard, self.shards)
        )
        pool = self._pool_with(mine, {c for c, _ in needed})
        if pool.live != len(mine):
            raise ValueError(f"the scoring pool holds {pool.live} batches, not {len(mine)}")
        row_of = np.full(n, -1, np.int64)
        row_of[mine] = np.flatnonzero(pool.alive[: pool.n])
        position_of = np.full(pool.n, -1, np.int64)
        position_of[row_of[mine]] = mine
        self._plan = _Plan(
            seq, world_size, [list(o) for o in overrides], np.ones(n, bool), row_of, position_of
        )

    def _pool_with(self, mine: np.ndarray, new: set[int]) -> Pool:
        """The pool of this composer's batches at buffer `mine`: the kept one (compacted when
        a quarter of it is dead) with the new files' batches added, or, for the first file and
        after a restore, one made from the files."""
        pool = self._pool
        if pool is None:
            pool = self._pool = Pool(self.classes.width, self.settings.vocab_size)
            new = {c for c, _ in self._by_file(mine)}
        elif pool.n - pool.live > pool.live // 4:
            pool.compact()
        files = [(c, g) for c, g in self._by_file(mine) if c in new]
        pool.reserve(
            sum(len(g) for _, g in files),
            sum(int(self._file_rows(c).length[self.index[g]].sum()) for c, g in files),
        )
        for c, group in files:
            pool.add(self._file_rows(c), self.index[group])
        pool.index()
        return pool

    def _by_file(self, positions: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """`positions` (buffer order, so grouped by candidate file) split by candidate seq."""
        if len(positions) == 0:
            return []
        cuts = np.flatnonzero(np.diff(self.cand[positions])) + 1
        return [(int(self.cand[g[0]]), g) for g in np.split(positions, cuts)]

    def _file_rows(self, c: int) -> FileRows:
        if c not in self._rows:
            self._rows[c] = FileRows.build(self._file(c), self.classes, self.corpus)
        return self._rows[c]

    def _current_pool(self) -> Pool:
        assert self._pool is not None, "begin builds the pool"
        return self._pool

    def _current_plan(self) -> _Plan:
        if self._plan is None:
            raise ValueError("no served file is being composed: begin first")
        return self._plan

    def _alpha(self, plan: _Plan) -> float:
        s = self.settings
        return alpha_for(
            s.schedule,
            plan.overrides,
            plan.seq,
            len(plan.picks),
            s.batches_per_file,
            plan.world_size,
            self.served_tokens * s.streams,  # "tokens": the job's, as the streams serve alike
        )

    def picks_left(self) -> int:
        """Batches the served file being composed still needs."""
        return self.settings.batches_per_file - len(self._current_plan().picks)

    def propose(self) -> tuple[float, int] | None:
        """(score, buffer position) of this composer's best batch for the next pick."""
        plan = self._current_plan()
        if len(plan.picks) >= self.settings.batches_per_file:
            raise ValueError(f"served seq {plan.seq} already has all its batches")
        weights = Weights(
            self.corpus, self.classes, self.served, self.served_tokens, self._alpha(plan)
        )
        found = best(self._current_pool(), weights)
        if found is None:
            return None
        score, row = found
        return score, int(plan.position_of[row])

    def accept(self, position: int) -> None:
        """Serve the batch at buffer `position`, whichever composer proposed it."""
        plan = self._current_plan()
        if not (0 <= position < len(plan.alive)) or not plan.alive[position]:
            raise ValueError(f"buffer position {position} is not a batch left to pick")
        alpha = self._alpha(plan)
        c, i = int(self.cand[position]), int(self.index[position])
        ids, counts = self._file(c).hist(i)
        eps_before = _EPS * (self.served_tokens + 1)
        pool = self._current_pool()
        pool.tighten(
            ids,
            counts,
            self.served,
            eps_before,
            _EPS * (self.served_tokens + int(counts.sum()) + 1),
            self.classes.rare,
        )
        self.served[ids] += counts.astype(np.int64)
        self.served_tokens += int(counts.sum())
        plan.alive[position] = False
        pool.kill(plan.row_of[position : position + 1][plan.row_of[position : position + 1] >= 0])
        plan.picks.append((c, i))
        plan.alphas.append(alpha)

    def cull_scores(self) -> list[list[float]]:
        """After the last pick: cull by age, and when the buffer is still over capacity, the
        [position, exact score] of this composer's batches that compete for it."""
        plan = self._current_plan()
        s = self.settings
        if len(plan.picks) != s.batches_per_file:
            raise ValueError(f"served seq {plan.seq} has {len(plan.picks)} batches, not all")
        self.alpha = plan.alphas[-1]
        old = plan.alive & (self.born <= plan.seq - s.max_age * s.streams)
        plan.aged = int(old.sum())
        plan.alive &= ~old
        pool = self._current_pool()
        pool.kill(plan.row_of[old & (plan.row_of >= 0)])
        plan.over = int(plan.alive.sum()) - s.capacity
        if plan.over <= 0:
            return []
        weights = Weights(self.corpus, self.classes, self.served, self.served_tokens, self.alpha)
        scores = exact(pool, weights)  # every row: their kept sums are fresh for the next file
        mine = np.flatnonzero(plan.alive & (plan.row_of >= 0))
        rows = plan.row_of[mine]
        return [[int(p), float(x)] for p, x in zip(mine, scores[rows], strict=True)]

    def finish(self, scored: Sequence[Sequence[float]]) -> Composition:
        """Keep the `capacity` best of every composer's cull_scores (the oldest on a tie),
        retire what is left of no batch, and close served file seq."""
        plan = self._current_plan()
        s = self.settings
        alive = plan.alive
        culled = plan.aged
        if plan.over > 0:
            positions = np.array([int(p) for p, _ in scored], np.int64)
            scores = np.array([float(x) for _, x in scored])
            if len(positions) != int(alive.sum()) or not alive[positions].all():
                raise ValueError("the cull scores do not cover the batches left in the buffer")
            keep = positions[np.lexsort((positions, -scores))[: s.capacity]]
            alive[:] = False
            alive[keep] = True
            culled += plan.over
            self._current_pool().kill(plan.row_of[~alive & (plan.row_of >= 0)])
        self.culled += culled
        self.picked += len(plan.picks)
        before = set(self.cand.tolist())
        self.cand, self.index, self.born = self.cand[alive], self.index[alive], self.born[alive]
        retired = sorted(before - set(self.cand.tolist()))
        self.plans += 1
        self._plan = None
        self._dirty = False
        return Composition(plan.picks, plan.alphas, retired, culled)

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
        """Publish served file `seq`: the picked (candidate seq, batch index) copied out of
        their candidate files (candidate_files.py)."""
        files = [(self._file(int(c)), int(i)) for c, i in picks]
        return write_served(directory, seq, files, alphas)

    # ---- snapshots (snapshot.py) ------------------------------------------------------------
    def save(self, path: Path) -> None:
        save_snapshot(self, path)

    def restore(self, path: Path) -> None:
        restore_snapshot(self, path)
        if self.next_candidate % self.settings.streams != self.stream:
            raise ValueError(f"{path} is a snapshot of another curriculum stream")

    def forget_derived(self) -> None:
        """Drop the pool, the plan and the mapped files: rebuilt from the state on next use."""
        self._pool = None
        self._plan = None
        self._dirty = False
        self._files.clear()
        self._rows.clear()

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
