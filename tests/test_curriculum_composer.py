"""The composer in-process: the neglect rule, determinism, snapshots, culling and retirement,
the alpha schedule, and the corpus distribution cache. Real candidate files in tmp_path."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from queue_client.batchfile import write_batch_file
from queue_client.errors import ConfigError
from queue_providers.base import token_histograms
from queue_server.curriculum.composer import Composer, ComposerSettings
from queue_server.curriculum.corpus import (
    cache_key,
    kl_divergence,
    load_or_estimate,
    tokenizer_identity,
)
from queue_server.curriculum.schedule import AlphaSchedule, alpha_for, check_points

VOCAB = 32
BATCH, BLOCK = 4, 16
NB = 8  # batches per candidate file and per served file


def skewed_batch(rng: np.random.Generator) -> np.ndarray:
    """A batch of one 'topic': Zipf-skewed ids with four of them twenty times likelier."""
    weights = 1.0 / np.arange(1, VOCAB + 1) ** 1.2
    topic = rng.choice(VOCAB, 4, replace=False)
    weights[topic] *= 20
    return rng.choice(VOCAB, size=(BATCH, BLOCK), p=weights / weights.sum())


def corpus_distribution() -> np.ndarray:
    """The expected distribution of skewed_batch, estimated from many draws."""
    rng = np.random.default_rng(99)
    counts = np.bincount(
        np.concatenate([skewed_batch(rng).ravel() for _ in range(4000)]), minlength=VOCAB
    )
    return counts / counts.sum()


class Candidates:
    """Candidate files written like a curriculum provider writes them, on demand by seq."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.paths: dict[int, Path] = {}

    def batches(self, seq: int) -> np.ndarray:
        rng = np.random.default_rng(seq)
        return np.stack([skewed_batch(rng) for _ in range(NB)])

    def path(self, seq: int) -> Path:
        if seq not in self.paths:
            x = torch.from_numpy(self.batches(seq)).to(torch.int64)
            tensors = {"x": x, "y": x.roll(-1, dims=-1)}
            meta = {
                "dataset": "d",
                "split": "train",
                "batch_size": BATCH,
                "schema": [
                    {"name": "x", "dtype": "int64", "shape": [BLOCK]},
                    {"name": "y", "dtype": "int64", "shape": [BLOCK]},
                ],
            }
            published = write_batch_file(
                self.dir,
                seq=seq,
                tensors=tensors,
                metadata=meta,
                extras=token_histograms(tensors, "x"),
            )
            self.paths[seq] = self.dir / str(published.name)
        return self.paths[seq]

    def fifo_tokens(self, n_batches: int) -> np.ndarray:
        """What FIFO serves: candidate batches in the order they were made."""
        out = [self.batches(seq) for seq in range(n_batches // NB)]
        return np.concatenate(out).ravel()


def settings(capacity: int = 64, alpha: float = 1.0, **kw) -> ComposerSettings:
    return ComposerSettings(
        vocab_size=VOCAB,
        batches_per_file=NB,
        candidate_batches_per_file=NB,
        capacity=capacity,
        oversample=2.0,
        schedule=AlphaSchedule(alpha, **kw),
    )


def compose(composer: Composer, cands: Candidates, seq: int, overrides=()) -> list[tuple[int, int]]:
    composer.attach({c: cands.path(c) for c in composer.held() + composer.needed()})
    result = composer.compose(seq, 1, list(overrides))
    composer.detach_unheld()
    return result.picks


def served_tokens(cands: Candidates, picks: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([cands.batches(c)[i].ravel() for c, i in picks])


# The stated margins, after 320 batches of a Zipf-skewed, topic-heavy corpus: toward uniform
# every batch is skewed, so the buffer can only do so much (FIFO 0.51 nats, curriculum 0.26);
# toward the corpus it cancels the sampling noise almost entirely (0.008 vs 0.00004).
@pytest.mark.parametrize("alpha, margin", [(1.0, 0.6), (0.0, 0.1)])
def test_curriculum_beats_fifo_on_kl_to_the_target(
    tmp_path: Path, alpha: float, margin: float
) -> None:
    cands, corpus = Candidates(tmp_path / "c"), corpus_distribution()
    composer = Composer(settings(alpha=alpha), corpus)
    picks = [p for seq in range(40) for p in compose(composer, cands, seq)]
    target = (1 - alpha) * corpus + alpha / VOCAB
    counts = lambda tokens: np.bincount(tokens, minlength=VOCAB).astype(np.float64)  # noqa: E731
    kl_curriculum = kl_divergence(counts(served_tokens(cands, picks)), target)
    kl_fifo = kl_divergence(counts(cands.fifo_tokens(len(picks))), target)
    assert kl_curriculum < margin * kl_fifo, (kl_curriculum, kl_fifo)
    assert composer.kl_to_target() == pytest.approx(kl_curriculum)


def test_every_candidate_batch_is_served_at_most_once_and_files_retire(tmp_path: Path) -> None:
    cands = Candidates(tmp_path / "c")
    composer = Composer(settings(capacity=24), corpus_distribution())
    seen: set[tuple[int, int]] = set()
    retired: set[int] = set()
    for seq in range(60):
        composer.attach({c: cands.path(c) for c in composer.held() + composer.needed()})
        result = composer.compose(seq, 1, [])
        composer.detach_unheld()
        assert len(result.picks) == NB and not (set(result.picks) & seen)
        seen |= set(result.picks)
        assert not (set(result.retired) & set(composer.held()))
        retired |= set(result.retired)
        assert len(composer.cand) <= 24
        # Culling by age keeps the oldest held file within the bound the disk window assumes.
        s = composer.settings
        assert composer.next_candidate - min(composer.held()) <= s.candidate_backlog
    assert len(retired) > 40  # old candidate files keep retiring
    ingested = composer.ingested
    assert ingested == len(seen) + composer.culled + len(composer.cand)


def test_same_calls_give_same_picks_and_a_snapshot_carries_on_exactly(tmp_path: Path) -> None:
    cands, corpus = Candidates(tmp_path / "c"), corpus_distribution()
    overrides = [[10, 0.0]]
    one = Composer(settings(), corpus)
    first = [compose(one, cands, s, overrides) for s in range(20)]
    two = Composer(settings(), corpus)
    for s in range(8):
        assert compose(two, cands, s, overrides) == first[s]
    two.save(tmp_path / "snap.npz")
    three = Composer(settings(), corpus)
    three.restore(tmp_path / "snap.npz")
    for s in range(8, 20):
        assert compose(three, cands, s, overrides) == first[s]


def test_an_override_changes_alpha_from_its_seq_on(tmp_path: Path) -> None:
    cands = Candidates(tmp_path / "c")
    composer = Composer(settings(alpha=1.0), corpus_distribution())
    alphas = []
    for seq in range(6):
        composer.attach({c: cands.path(c) for c in composer.held() + composer.needed()})
        alphas.append(composer.compose(seq, 1, [[3, 0.25]]).alphas)
        composer.detach_unheld()
    assert alphas[:3] == [[1.0] * NB] * 3 and alphas[3:] == [[0.25] * NB] * 3


def test_schedule_interpolates_and_overrides_win() -> None:
    sched = AlphaSchedule(1.0, ((0, 1.0), (100, 0.0)), "step")
    assert sched.scheduled(0, 0) == 1.0 and sched.scheduled(50, 0) == 0.5
    assert sched.scheduled(1000, 0) == 0.0
    by_tokens = AlphaSchedule(1.0, ((10, 0.8), (20, 0.4)), "tokens")
    assert by_tokens.scheduled(0, 5) == 0.8 and by_tokens.scheduled(0, 15) == pytest.approx(0.6)
    # step of batch 3 of file 4 at world size 2: (4 // 2) * 10 + 3 = 23
    assert alpha_for(sched, [], 4, 3, 10, 2, 0) == pytest.approx(0.77)
    assert alpha_for(sched, [[4, 0.1]], 4, 3, 10, 2, 0) == 0.1
    assert alpha_for(sched, [[4, 0.1], [4, None]], 4, 3, 10, 2, 0) == pytest.approx(0.77)
    assert alpha_for(sched, [[5, 0.1]], 4, 3, 10, 2, 0) == pytest.approx(0.77)


@pytest.mark.parametrize(
    "points, fault",
    [
        ("x", "a list"),
        ([[0, 1.5]], "alpha must be in"),
        ([[10, 1.0], [5, 0.0]], "increase"),
        ([[0, 1.0, 2]], "expected \\[x, alpha\\]"),
    ],
)
def test_bad_schedules_are_named(points, fault: str) -> None:
    with pytest.raises(ConfigError, match=fault):
        check_points(points, "datasets.d.curriculum_schedule")


def test_corpus_distribution_is_cached_under_its_key_with_a_progress_bar(tmp_path: Path) -> None:
    calls = []

    def count(advance):
        calls.append(1)
        for _ in range(4):
            advance(250)
        return np.arange(VOCAB, dtype=np.int64)

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    path = tmp_path / "curriculum" / "corpus-k.npy"
    dist = load_or_estimate(path, count, 1000, "d/train", progress_console=console)
    assert dist.sum() == pytest.approx(1.0) and path.exists()
    assert "estimating corpus distribution" in console.file.getvalue()
    assert "1000/1000" in console.file.getvalue()
    again = load_or_estimate(path, count, 1000, "d/train", progress_console=console)
    assert calls == [1] and np.array_equal(dist, again)


def test_the_cache_key_moves_with_data_sample_size_and_tokenizer() -> None:
    meta = {"vocab_size": 32, "stoi": {"a": 0}, "block_size": 8}
    base = cache_key("data-1", 1000, "train", "x", meta)
    assert cache_key("data-2", 1000, "train", "x", meta) != base
    assert cache_key("data-1", 2000, "train", "x", meta) != base
    assert cache_key("data-1", 1000, "train", "x", {**meta, "stoi": {"b": 0}}) != base
    assert cache_key("data-1", 1000, "train", "x", {**meta, "block_size": 16}) == base
    assert tokenizer_identity(meta) == tokenizer_identity(dict(reversed(meta.items())))


def test_lazy_picks_equal_rescoring_the_whole_buffer(tmp_path: Path, monkeypatch) -> None:
    """Every pick (alpha moving every batch, by the schedule) is the batch a full rescoring of
    the buffer would pick: the lazy bounds never hide a better batch."""
    from queue_server.curriculum import composer as module

    lazy = module._Parts.best
    checked = []

    def best(self, alive, alpha):
        chosen = lazy(self, alive, alpha)
        c = self.c
        scores = np.full(len(self.hists), -np.inf)
        for j in np.flatnonzero(alive):
            ids, counts = self.hists[j]
            g = 1.0 / (c.served[ids] + 1e-9 * (c.served_tokens + 1))
            corpus_part = float(counts @ (c.corpus[ids] * g))
            uniform_part = float(counts @ g) / c.settings.vocab_size
            scores[j] = (1 - alpha) * corpus_part + alpha * uniform_part
        # The same batch, or one whose score is equal but for rounding in the last bits.
        checked.append(scores[chosen] >= scores.max() * (1 - 1e-12))
        return chosen

    monkeypatch.setattr(module._Parts, "best", best)
    cands = Candidates(tmp_path / "c")
    composer = Composer(settings(points=((0, 1.0), (100, 0.0))), corpus_distribution())
    for seq in range(20):
        compose(composer, cands, seq)
    assert len(checked) == 20 * NB and all(checked)
