"""The pure schedule: which seq each rank reads, windows, best-effort lead, elastic changes."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_client import errors
from queue_client.world import World
from queue_server.config.served_ranks import ServedRanks
from queue_server.split.schedule import BEST_EFFORT, DETERMINISTIC, MAX_WORLD_SIZE, Schedule


def _walk(schedule: Schedule, rank: int, files: int) -> list[int]:
    """The seqs a rank reads when it asks for its next file `files` times."""
    seqs = []
    for _ in range(files):
        seq = schedule.next_for(rank)
        schedule.note_request(rank, seq, pin=False)
        schedule.note_consumed(rank, seq)
        seqs.append(seq)
    return seqs


@given(world_size=st.integers(1, 64), rounds=st.integers(1, 20))
def test_ranks_are_disjoint_and_cover_every_seq(world_size: int, rounds: int) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=2, world_size=world_size)
    streams = [_walk(schedule, r, rounds) for r in range(world_size)]
    seen = [s for stream in streams for s in stream]
    assert sorted(seen) == list(range(world_size * rounds))  # every seq once, none twice
    for rank, stream in enumerate(streams):
        assert all(s % world_size == rank for s in stream)
        assert stream == sorted(stream)


@given(
    world_size=st.integers(1, 16),
    backlog=st.integers(0, 8),
    held=st.dictionaries(st.integers(0, 15), st.integers(0, 500), max_size=16),
)
def test_a_window_holds_backlog_plus_two_files_of_its_rank(
    world_size: int, backlog: int, held: dict[int, int]
) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=backlog, world_size=world_size)
    held = {
        r % world_size: r % world_size + world_size * (s // world_size) for r, s in held.items()
    }
    for rank in range(world_size):
        frontier = schedule.frontier(rank, held)
        inside = [s for s in range(frontier, frontier + 1000) if s % world_size == rank]
        inside = [s for s in inside if schedule.in_window(s, held)]
        assert inside == [frontier + world_size * i for i in range(backlog + 2)]


@pytest.mark.parametrize(
    ("asked", "then", "pin", "position"),
    [
        # (first request, second request, pinned?, the rank's recorded position after)
        (8, 12, False, 12),  # forward
        (12, 8, False, 12),  # one file back: the prefetched file asked again, not a rewind
        (20, 8, False, 8),  # further back: a rewind to a checkpoint
        (20, 8, True, 20),  # a lease taken back after a restart never rewinds
    ],
)
def test_rewinds_and_pins(asked: int, then: int, pin: bool, position: int) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=4)
    schedule.note_request(0, asked, pin=False)
    schedule.note_request(0, then, pin=pin)
    assert schedule.last_acquired[0] == position
    assert schedule.next_for(0) == position + 4


def test_another_ranks_seq_does_not_move_a_position() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=4)
    schedule.note_request(1, 6, pin=False)  # seq 6 is rank 2's (a carried file)
    assert schedule.next_for(1) == 1


@pytest.mark.parametrize(
    ("rank", "world_size", "seq", "message"),
    [
        (0, 0, None, "world_size 0 is outside"),
        (0, MAX_WORLD_SIZE + 1, None, "is outside [1, 65536]"),
        (4, 4, None, "rank 4 is outside [0, world_size=4)"),
        (-1, 4, None, "rank -1 is outside"),
        (0, 4, -3, "seq -3 is negative"),
        (1, 4, 6, "seq 6 belongs to rank 2 of world_size 4, not to rank 1"),
    ],
)
def test_bad_requests_are_named(rank: int, world_size: int, seq: int | None, message: str) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1)
    with pytest.raises(
        errors.InvalidRequest,
        match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)"),
    ):
        schedule.check(rank, world_size, seq, carried=False)


def test_a_carried_seq_may_belong_to_another_rank() -> None:
    Schedule(DETERMINISTIC, max_backlog_files=1).check(1, 4, 6, carried=True)


def test_elastic_change_repartitions_and_refuses_while_others_hold_leases() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=4)
    _walk(schedule, 0, 3)
    with pytest.raises(errors.LeaseConflict, match="world_size 2 conflicts"):
        schedule.adopt(2, live_world_sizes={4}, where="d/train")
    schedule.adopt(2, live_world_sizes=set(), where="d/train")
    assert schedule.world_size == 2
    assert schedule.next_for(0) == 0 and schedule.next_for(1) == 1  # reckoned anew


def test_lowest_unread_and_stateless_skip_floor() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=2)
    schedule.note_request(0, 40, pin=False)
    schedule.note_request(1, 31, pin=False)
    # Rank 1 asked for 31 and holds no lease on it: it may still be waiting for it.
    assert schedule.lowest_unread({}) == 31
    assert schedule.lowest_unread({0: 38, 1: 31}) == 31
    assert schedule.lowest_unread({0: 30}) == 30
    schedule.note_request(1, 33, pin=False)  # 31 read and released: 33 asked for next
    assert schedule.lowest_unread({0: 40}) == 33


def test_ahead_of_requests_covers_each_ranks_window_after_its_request() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=2)
    schedule.note_request(1, 9, pin=False)
    assert [list(r) for r in schedule.ahead_of_requests({1: 9})] == [[11, 13]]


def test_best_effort_lead_and_room() -> None:
    schedule = Schedule(BEST_EFFORT, max_backlog_files=2, max_lead=2, world_size=2)
    assert schedule.may_take(0)
    schedule.note_consumed(0, 0)
    schedule.note_consumed(0, 1)
    assert not schedule.may_take(0)  # two files ahead of rank 1
    schedule.note_consumed(1, 2)
    assert schedule.may_take(0)
    assert schedule.best_effort_room(unleased_files=3, in_production=0)
    assert not schedule.best_effort_room(unleased_files=3, in_production=1)


def test_a_change_point_lies_a_round_past_the_callers_window() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=2, world_size=4)
    # position 9 is in round 2; backlog 2 + reading + prefetched + one more round -> round 7
    assert schedule.change_point(9, earliest=0) == 28
    assert schedule.change_point(9, earliest=40) == 40


# ---- node-local: a server of some ranks ---------------------------------------------------

NODE = ServedRanks(frozenset({2, 3}), world_size=4)


@pytest.mark.parametrize(
    ("rank", "world_size", "message"),
    [
        # (rank, world size asked at, what NotServed says)
        (0, 4, "rank 0 of world_size 4 is not served here: this server serves ranks 2-3 of"),
        (1, 2, "world_size 2 is not the world this server serves: it serves ranks 2-3 of"),
        (2, 8, "world_size 8 is not the world this server serves"),
    ],
)
def test_a_node_local_schedule_names_the_ranks_it_serves(
    rank: int, world_size: int, message: str
) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=4, served=NODE)
    with pytest.raises(errors.NotServed, match=re.escape(message)):
        schedule.check(rank, world_size, None, carried=False)
    assert schedule.check(3, 4, 11, carried=False) == World(3, 4)
    schedule.check(2, 4, 5, carried=True)  # a carried file may be any rank's


def test_only_the_served_ranks_windows_count() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=4, served=NODE)
    assert list(schedule.active_ranks({})) == [2, 3]
    assert schedule.lowest_unread({}) == 2  # ranks 0 and 1 would say 0
    assert [s for s in range(12) if schedule.serves_seq(s)] == [2, 3, 6, 7, 10, 11]


@pytest.mark.parametrize(
    ("served", "world_size", "slot", "slots", "start", "expected"),
    [
        # (ranks served, world size, slot, slots, start: the slot's first seq for those ranks)
        (None, 4, 1, 2, 0, 1),  # every rank: simply the slot's next seq
        ({2, 3}, 4, 0, 1, 0, 2),
        ({2, 3}, 4, 0, 1, 4, 6),
        ({2, 3}, 4, 0, 2, 3, 6),  # slot 0 of 2 makes the even seqs: rank 2's
        ({2, 3}, 4, 1, 2, 0, 3),
        ({1}, 4, 0, 2, 0, None),  # rank 1's seqs are odd: slot 0 never makes one
        ({0}, 3, 1, 2, 0, 3),  # seq 3 is rank 0's of 3, and odd
    ],
)
def test_next_served_seq(
    served: set[int] | None,
    world_size: int,
    slot: int,
    slots: int,
    start: int,
    expected: int | None,
) -> None:
    ranks = None if served is None else frozenset(served)
    schedule = Schedule(
        DETERMINISTIC, 1, world_size=world_size, served=ServedRanks(ranks, world_size)
    )
    assert schedule.next_served_seq(start, slot, slots) == expected


@given(
    world_size=st.integers(1, 8),
    slots=st.integers(1, 4),
    data=st.data(),
    start=st.integers(0, 40),
)
def test_next_served_seq_is_the_first_such_seq(
    world_size: int, slots: int, data: st.DataObject, start: int
) -> None:
    served = data.draw(st.frozensets(st.integers(0, world_size - 1), min_size=1))
    slot = data.draw(st.integers(0, slots - 1))
    schedule = Schedule(
        DETERMINISTIC, 1, world_size=world_size, served=ServedRanks(served, world_size)
    )
    period = math.lcm(world_size, slots)
    brute = [
        s for s in range(start, start + period) if s % slots == slot and s % world_size in served
    ]
    assert schedule.next_served_seq(start, slot, slots) == (brute[0] if brute else None)


def test_first_unread_counts_the_seq_a_rank_waits_for() -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=1, world_size=2)
    assert schedule.first_unread(1, {}) == 1  # nothing asked yet
    schedule.note_request(1, 9, pin=False)
    assert schedule.first_unread(1, {}) == 9  # asked for, not yet leased: not read
    assert schedule.first_unread(1, {1: 7}) == 7  # still holds an older file


@pytest.mark.parametrize(
    ("held", "asked", "next_forward", "seq", "blamed"),
    [
        # One slot stuck at seq 9 of rank 1, which holds seq 1 (its window is 1..7): rank 0's
        # seq 10 waits. (A rank not heard from at all is taken to be where rank 0 is.)
        ({1: 1}, {0: 10}, [9], 10, "rank 1 has not read its seqs 1, 3, 5, 7"),
        # Rank 1 holds seq 5: its window runs 5..11, so seq 13 stops the slot.
        ({1: 5}, {0: 14}, [13], 14, "rank 1 has not read its seqs 5, 7, 9, 11"),
        # Two slots: seq 10 is slot 0's, which is stuck at rank 0's own seq 8 (in its window).
        ({}, {0: 10}, [8, 9], 10, None),
        # The slot's next seq is in its rank's window: production is slow, not shut.
        ({}, {0: 6}, [5], 6, None),
        # The slot is past seq already (made, or being made).
        ({}, {0: 6}, [7], 6, None),
    ],
)
def test_a_seq_held_back_by_another_ranks_window_names_that_rank(
    held: dict[int, int],
    asked: dict[int, int],
    next_forward: list[int],
    seq: int,
    blamed: str | None,
) -> None:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=2, world_size=2)
    for rank, s in asked.items():
        schedule.note_request(rank, s, pin=False)
    why = schedule.window_shut(0, seq, [], held, next_forward)
    if blamed is None:
        assert why == ""
    else:
        assert blamed in why and "ranks must advance together" in why, why
        # Without the production facts, only the rank's own leases are judged.
        assert schedule.window_shut(0, seq, []) == ""
