"""Curriculum streams (`curriculum_streams`): which served seqs and candidates each stream
owns, and which streams a node-local server composes. Pure arithmetic, tested with tables.

Stream k of S composes the served seqs k, k+S, k+2S, ... in order, from candidates of its own
(candidate seqs k, k+S, ...), with its own buffer and served counts: a pure function of the
config and k. Rank r of W reads seqs r, r+W, ...; so when W divides S each stream's seqs are
one rank's, and a node composes the streams of its ranks and nothing else. Otherwise a stream
holds seqs of several ranks (of every rank with S = 1), and each node that serves one of them
composes the whole stream, passing over (composing without writing) the seqs of the others.

The trade-off: the target is tracked per stream, not over the whole job. Each stream's served
distribution comes as close to the target as one composer's does (over its own candidates),
and the job's, the sum of the streams', is at least as close as their average (KL is convex).
"""

from __future__ import annotations

import math

from queue_server.config.served_ranks import EVERY_RANK, ServedRanks


def node_streams(served: ServedRanks, streams: int) -> frozenset[int] | None:
    """The streams holding a seq of a rank served here; None for one server of every rank.

    Seq s is in stream s mod S and read by rank s mod W; both hold for some s exactly when
    the rank and the stream agree mod gcd(S, W)."""
    if served.ranks is None:
        return None
    common = math.gcd(streams, served.world_size)
    residues = {r % common for r in served.ranks}
    return frozenset(k for k in range(streams) if k % common in residues)


def shared_streams(served: ServedRanks, streams: int) -> list[int]:
    """The streams composed here that also hold seqs of ranks served elsewhere: every node
    of those ranks composes them in full."""
    if served.ranks is None:
        return []
    w = served.world_size
    common = math.gcd(streams, w)
    here: dict[int, int] = {}
    for r in served.ranks:
        here[r % common] = here.get(r % common, 0) + 1
    partial = {c for c, n in here.items() if n < w // common}
    return [k for k in range(streams) if k % common in partial]


def candidate_ranks(served: ServedRanks, streams: int) -> ServedRanks:
    """The ranks of the candidate queue: its "rank" k is stream k, of a world of S streams.
    It makes only the candidates of the streams composed here; another stream's are made on
    demand (a carried file after an elastic resume may be of any stream)."""
    mine = node_streams(served, streams)
    if mine is None or len(mine) == streams:
        return EVERY_RANK
    return ServedRanks(mine, streams)


def candidate_rank(seq: int, streams: int, candidates: ServedRanks) -> int:
    """The rank that asks the candidate queue for candidate `seq`: its stream, when that is
    composed here (its window moves with it), else the first stream composed here (the
    request is then a carried one, made whatever its rank)."""
    stream = seq % streams
    if candidates.serves(stream):
        return stream
    assert candidates.ranks, "a node composes at least one stream"
    return min(candidates.ranks)
