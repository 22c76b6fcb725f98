"""Curriculum streams (`curriculum_streams`): which streams a node composes (a table), and a
stream in-process: its own seqs and candidates only, in order, from its own snapshot only.
Real candidate files in tmp_path (test_curriculum_composer's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_curriculum_composer import Candidates, corpus_distribution, settings

from queue_server.config.served_ranks import EVERY_RANK, ServedRanks
from queue_server.curriculum.composer import Composer
from queue_server.curriculum.settings import ComposerSettings
from queue_server.curriculum.streams import (
    candidate_rank,
    candidate_ranks,
    node_streams,
    shared_streams,
)


def node(ranks: set[int], world: int) -> ServedRanks:
    return ServedRanks(frozenset(ranks), world)


@pytest.mark.parametrize(
    "ranks, world, streams, mine, shared",
    [
        ({0, 1}, 4, 4, {0, 1}, []),  # streams = world size: a node's streams are its ranks'
        ({2, 3}, 4, 8, {2, 3, 6, 7}, []),  # a multiple: two streams per rank
        ({0}, 2, 4, {0, 2}, []),  # after an elastic resume to 2 ranks: still its own
        ({0, 1}, 4, 1, {0}, [0]),  # one stream for the job: every node composes all of it
        ({0, 1}, 4, 2, {0, 1}, [0, 1]),  # stream 0 holds ranks 0 and 2: both nodes compose it
        ({0, 2}, 4, 2, {0}, []),  # ... unless one node serves both of its ranks
        ({1}, 3, 2, {0, 1}, [0, 1]),  # coprime: every stream meets every rank
    ],
)
def test_the_streams_a_node_composes(
    ranks: set[int], world: int, streams: int, mine: set[int], shared: list[int]
) -> None:
    served = node(ranks, world)
    assert node_streams(served, streams) == mine
    assert shared_streams(served, streams) == shared
    # Brute force: stream k holds a seq of a rank served here.
    span = streams * world
    assert mine == {s % streams for s in range(span) if s % world in ranks}


def test_the_candidate_queue_serves_the_streams_composed_here() -> None:
    assert candidate_ranks(EVERY_RANK, 4) == EVERY_RANK
    assert candidate_ranks(node({0, 1}, 4), 1) == EVERY_RANK  # the one stream: every candidate
    here = candidate_ranks(node({2, 3}, 4), 8)
    assert here == node({2, 3, 6, 7}, 8)
    # A candidate of a stream composed here is asked for as its stream; another stream's
    # (a carried file after an elastic resume) by the first stream here, carried.
    assert [candidate_rank(c, 8, here) for c in (6, 10, 15, 16)] == [6, 2, 7, 2]
    assert [candidate_rank(c, 4, EVERY_RANK) for c in (0, 5, 7)] == [0, 1, 3]


def streamed(streams: int, **kw: object) -> ComposerSettings:
    return ComposerSettings(**{**settings(capacity=24, **kw).__dict__, "streams": streams})


def compose(composer: Composer, cands: Candidates, seq: int) -> list[tuple[int, int]]:
    composer.attach({c: cands.path(c) for c in composer.held() + composer.needed()})
    picks = composer.compose(seq, 4, []).picks
    composer.detach_unheld()
    return picks


def test_a_stream_composes_its_own_seqs_from_its_own_candidates(tmp_path: Path) -> None:
    cands, corpus = Candidates(tmp_path / "c"), corpus_distribution()
    stream = Composer(streamed(3), corpus, stream=2)
    assert stream.needed()[:3] == [2, 5, 8] and stream.next_seq == 2
    with pytest.raises(ValueError, match="served seq 0 composed out of order: the next is 2"):
        stream.compose(0, 4, [])
    picks = [compose(stream, cands, seq) for seq in (2, 5, 8, 11, 14, 17)]
    assert {c % 3 for p in picks for c, _ in p} == {2}
    assert len({x for p in picks for x in p}) == 6 * len(picks[0])  # none served twice
    stream.save(tmp_path / "composer-17.npz")
    with pytest.raises(ValueError, match="a snapshot of another curriculum stream"):
        Composer(streamed(3), corpus, stream=1).restore(tmp_path / "composer-17.npz")
    again = Composer(streamed(3), corpus, stream=2)
    again.restore(tmp_path / "composer-17.npz")
    assert again.next_seq == 20 and compose(again, cands, 20) == compose(stream, cands, 20)


def test_one_stream_is_the_composer_it_always_was(tmp_path: Path) -> None:
    """curriculum_streams = 1 changes nothing: the same picks as a composer without it."""
    cands, corpus = Candidates(tmp_path / "c"), corpus_distribution()
    one, plain = Composer(streamed(1), corpus), Composer(settings(capacity=24), corpus)
    assert [compose(one, cands, s) for s in range(8)] == [
        compose(plain, cands, s) for s in range(8)
    ]


def test_the_tokens_schedule_counts_the_jobs_tokens_as_the_streams_serve_alike(
    tmp_path: Path,
) -> None:
    """With unit "tokens", a stream of S reads the schedule at S times its own served tokens:
    about the job's, as every stream serves alike."""
    cands, corpus = Candidates(tmp_path / "c"), corpus_distribution()
    points = ((0, 1.0), (4096, 0.0))
    stream = Composer(streamed(4, points=points, unit="tokens"), corpus, stream=1)
    compose(stream, cands, 1)  # 8 batches of 4 x 16 tokens: 512 served
    stream.attach({c: cands.path(c) for c in stream.held() + stream.needed()})
    alphas = stream.compose(5, 4, []).alphas
    assert alphas[0] == pytest.approx(1.0 - 4 * 512 / 4096)
