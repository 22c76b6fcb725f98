"""The composer in-process: the neglect rule, determinism, snapshots, culling and retirement,
the alpha schedule, and the corpus distribution cache. Real candidate files in tmp_path."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from queue_client.errors import ConfigError
from queue_client.format.batchfile import write_batch_file
from queue_providers.histograms import token_histograms
from queue_server.curriculum.composer import Composer, ComposerSettings
from queue_server.curriculum.corpus import (
    cache_key,
    kl_divergence,
    load_or_estimate,
    tokenizer_identity,
)
from queue_server.curriculum.schedule import AlphaSchedule, alpha_for, check_points
from queue_server.curriculum.shards import best_of

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


def test_every_pick_is_the_best_batch_of_a_full_rescoring(tmp_path: Path, monkeypatch) -> None:
    """Every pick (alpha moving every batch, by the schedule) is the batch of the highest
    score in a full rescoring of the buffer in extended precision: the bounds never hide a
    better batch. (tests/test_curriculum_scoring.py checks the scoring against the one it
    replaced.)"""
    from queue_server.curriculum import composer as module

    fast = module.best
    checked = []

    def best(pool, weights):
        found = fast(pool, weights)
        c = composer
        ld = np.longdouble
        eps = ld(1e-9) * (c.served_tokens + 1)
        a = ld(weights.alpha)
        scores = {}
        for position in np.flatnonzero(c._plan.alive):
            ids, counts = c._file(int(c.cand[position])).hist(int(c.index[position]))
            target = (1 - a) * c.corpus[ids].astype(ld) + a / c.settings.vocab_size
            g = 1 / (c.served[ids].astype(ld) + eps)
            scores[int(c._plan.row_of[position])] = np.sum(counts.astype(ld) * target * g)
        top = max(scores.values())
        checked.append(scores[found[1]] >= top * (1 - 1e-12))
        return found

    monkeypatch.setattr(module, "best", best)
    cands = Candidates(tmp_path / "c")
    composer = Composer(settings(points=((0, 1.0), (100, 0.0))), corpus_distribution())
    for seq in range(20):
        compose(composer, cands, seq)
    assert len(checked) == 20 * NB and all(checked)


class ZipfCandidates(Candidates):
    """Candidates over a 20,000-token vocabulary: head, tail and rare tokens all in play."""

    vocab = 20_000

    def batches(self, seq: int) -> np.ndarray:
        rng = np.random.default_rng(seq)
        p = 1.0 / np.arange(1, self.vocab + 1) ** 1.05
        return rng.choice(self.vocab, size=(NB, BATCH, 256), p=p / p.sum())

    def path(self, seq: int) -> Path:
        if seq not in self.paths:
            x = torch.from_numpy(self.batches(seq)).to(torch.int64)
            meta = {
                "dataset": "d",
                "split": "train",
                "batch_size": BATCH,
                "schema": [{"name": "x", "dtype": "int64", "shape": [256]}],
            }
            published = write_batch_file(
                self.dir,
                seq=seq,
                tensors={"x": x},
                metadata=meta,
                extras=token_histograms({"x": x}, "x"),
            )
            self.paths[seq] = self.dir / str(published.name)
        return self.paths[seq]


def compose_shared(composers: list[Composer], cands: Candidates, seq: int, overrides) -> tuple:
    """Drive composers that share a buffer step by step, as the lane does (answers taken in a
    shuffled order: the pick must not depend on it)."""
    for c in composers:
        c.attach({k: cands.path(k) for k in c.held() + c.needed()})
        c.begin(seq, 2, overrides)
    rng = np.random.default_rng(seq)
    while composers[0].picks_left():
        proposals = [c.propose() for c in composers]
        position = best_of([proposals[i] for i in rng.permutation(len(proposals))])
        for c in composers:
            c.accept(position)
    scored = [s for c in composers for s in c.cull_scores()]
    results = [c.finish(list(reversed(scored))) for c in composers]
    for c in composers:
        c.detach_unheld()
    assert all(r == results[0] for r in results)
    return results[0].picks, results[0].alphas, results[0].retired


def test_composers_sharing_the_buffer_pick_what_one_composer_picks(tmp_path: Path) -> None:
    """One, two and three composers over the same candidates, with a schedule and an
    override: the same picks, alphas and retirements file after file, and the same snapshot."""
    cands = ZipfCandidates(tmp_path / "c")
    p = 1.0 / np.arange(1, cands.vocab + 1) ** 1.05
    corpus = p / p.sum()
    cfg = ComposerSettings(cands.vocab, NB, NB, 40, 2.0, AlphaSchedule(1.0, ((0, 1.0), (60, 0.2))))
    overrides = [[14, 0.7]]
    runs = {}
    for shards in (1, 2, 3):
        composers = [Composer(cfg, corpus, shard, shards) for shard in range(shards)]
        runs[shards] = [compose_shared(composers, cands, seq, overrides) for seq in range(24)]
        composers[-1].save(tmp_path / f"snap-{shards}.npz")
    assert runs[1] == runs[2] == runs[3]
    alone = Composer(cfg, corpus)
    assert [
        (r.picks, r.alphas, r.retired)
        for r in (compose_result(alone, cands, seq, overrides) for seq in range(24))
    ] == runs[1]
    snaps = [np.load(tmp_path / f"snap-{shards}.npz") for shards in (1, 2, 3)]
    for key in snaps[0].files:
        assert all(np.array_equal(snaps[0][key], s[key]) for s in snaps[1:]), key


def compose_result(composer: Composer, cands: Candidates, seq: int, overrides):
    composer.attach({c: cands.path(c) for c in composer.held() + composer.needed()})
    result = composer.compose(seq, 2, list(overrides))
    composer.detach_unheld()
    return result


@pytest.mark.parametrize(
    "shape, high, dtype",
    [
        ((6, 4, 32), 65, torch.int64),
        ((3, 2, 50), 50_257, torch.int32),  # one sort, not a dense count
        ((5, 17), 300, torch.int16),
        ((4, 3, 8), 2_000_000, torch.int64),
        ((5, 2, 40), 65_536, torch.uint16),  # narrow ids as a window stores them
        ((3, 2, 5000), 300_000, torch.int64),  # sorted per batch, not counted densely
    ],
)
def test_token_histograms_count_every_batch_at_once(shape, high: int, dtype) -> None:
    """The candidate histograms (providers' token_histograms, vectorised over the batches of a
    file) equal one torch.unique per batch, padding labels (-1) left out."""
    gen = torch.Generator().manual_seed(high)
    x = torch.randint(-1, high, shape, generator=gen).to(dtype)
    got = token_histograms({"x": x}, "x")
    if dtype == torch.uint16:  # a view that is not contiguous, as x of a stored window
        window = torch.cat([x, x[..., :1]], -1)
        view = token_histograms({"x": window[..., :-1]}, "x")
        assert all(np.array_equal(got[k], view[k]) for k in got)
        as_numpy = token_histograms({"x": window[..., :-1].numpy()}, "x")  # numpy in: the same
        assert all(np.array_equal(got[k], as_numpy[k]) for k in got)
    offsets, ids, counts = [0], [], []
    for batch in x.reshape(shape[0], -1).to(torch.int64):
        unique, count = torch.unique(batch[batch >= 0], return_counts=True)
        ids.append(unique)
        counts.append(count)
        offsets.append(offsets[-1] + len(unique))
    assert got["token_hist_offsets"].tolist() == offsets
    assert got["token_hist_ids"].dtype == np.int32 == got["token_hist_counts"].dtype
    assert np.array_equal(got["token_hist_ids"], torch.cat(ids).numpy())
    assert np.array_equal(got["token_hist_counts"], torch.cat(counts).numpy())


def test_token_histograms_of_a_file_of_padding_only_are_empty() -> None:
    """Labels that are all padding (-100, as token classification pads) count nothing, in
    every batch, rather than failing on a negative id span."""
    got = token_histograms({"labels": torch.full((3, 2, 5), -100)}, "labels")
    assert got["token_hist_offsets"].tolist() == [0, 0, 0, 0]
    assert got["token_hist_ids"].size == 0 == got["token_hist_counts"].size


@pytest.mark.parametrize(
    "values",
    [
        torch.zeros((2, 3), dtype=torch.float32),
        torch.zeros((2, 3), dtype=torch.bfloat16),  # numpy has no such dtype
        torch.zeros((2, 3), dtype=torch.bool),
        np.zeros((2, 3), dtype=np.float64),
    ],
    ids=["float32", "bfloat16", "bool", "numpy-float64"],
)
def test_token_histograms_of_a_field_that_holds_no_ids_are_refused_naming_it(values) -> None:
    from queue_client.errors import MetaError

    with pytest.raises(MetaError, match=r"histogram field 'w' holds .*, not token ids"):
        token_histograms({"w": values}, "w")
