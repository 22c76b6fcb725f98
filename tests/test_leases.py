"""The lease table with an injected clock: grant, renew, expire, release, take-over, lookup."""

from __future__ import annotations

import logging

import pytest

from queue_client import errors
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.split.leases import LeaseDirectory, LeaseTable, ReleaseOutcome


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(directory: LeaseDirectory[str] | None = None) -> tuple[LeaseTable, Clock]:
    clock = Clock()
    directory = directory if directory is not None else LeaseDirectory()
    table = LeaseTable(
        "d/train",
        ttl_s=10.0,
        clock=clock,
        on_add=lambda lid: directory.add(lid, "d/train"),
        on_remove=directory.discard,
    )
    return table, clock


def test_release_outcomes_match_the_wire() -> None:
    wire = {name: pb.ReleaseOutcome.Value(name) for name in pb.ReleaseOutcome.keys()}
    ours = {o.name: o.value for o in ReleaseOutcome}
    assert {k: v for k, v in wire.items() if k in ours} == ours
    assert set(ours) <= set(wire)


def test_expiry_follows_the_clock_and_renewal_moves_it() -> None:
    table, clock = _table()
    a = table.grant(0, rank=0, world_size=1, client_id="c1")
    b = table.grant(1, rank=0, world_size=1, client_id="c1")
    assert table.seconds_to_next_expiry() == 10.0
    clock.now += 6
    assert table.renew(a.lease_id, "c1")
    assert not table.renew(a.lease_id, "someone-else")
    clock.now += 5  # b is 11 s old, a was renewed 5 s ago
    assert [lease.seq for lease in table.expire()] == [1]
    assert b.lease_id not in table and a.lease_id in table
    assert table.seconds_to_next_expiry() == 5.0
    clock.now += 5
    assert [lease.seq for lease in table.expire()] == [0]
    assert table.seconds_to_next_expiry() is None


def test_the_same_client_gets_the_same_lease_and_a_new_client_takes_over() -> None:
    table, clock = _table()
    first = table.grant(7, rank=3, world_size=4, client_id="old")
    clock.now += 3
    again = table.grant(7, rank=3, world_size=4, client_id="old")
    assert again is first and again.expires_at == 113.0
    new = table.grant(7, rank=3, world_size=4, client_id="new")
    assert new.lease_id != first.lease_id
    assert first.lease_id not in table and table.holder(7) is new


def test_release_checks_holder_and_outcome() -> None:
    table, _ = _table()
    lease = table.grant(0, rank=0, world_size=1, client_id="c1")
    with pytest.raises(errors.LeaseConflict, match="belongs to another client"):
        table.check_release(lease.lease_id, "c2", ReleaseOutcome.CONSUMED)
    with pytest.raises(errors.InvalidRequest, match="outcome 9 is not CONSUMED"):
        table.check_release(lease.lease_id, "c1", 9)
    with pytest.raises(errors.UnknownLease, match="is not held"):
        table.check_release("nope", "c1", ReleaseOutcome.CONSUMED)
    assert table.check_release(lease.lease_id, "c1", ReleaseOutcome.RETURNED) is lease


def test_the_directory_finds_a_lease_until_it_is_dropped() -> None:
    directory: LeaseDirectory[str] = LeaseDirectory()
    table, _ = _table(directory)
    lease = table.grant(2, rank=0, world_size=1, client_id="c1")
    assert directory.owner_of(lease.lease_id) == "d/train"
    table.drop(lease)
    with pytest.raises(errors.UnknownLease):
        directory.owner_of(lease.lease_id)
    with pytest.raises(errors.InvalidRequest, match="malformed"):
        directory.owner_of("x" * 500)


def test_lowest_held_and_counts_per_rank() -> None:
    table, _ = _table()
    for seq, rank in ((9, 1), (5, 1), (4, 0), (13, 1)):
        table.grant(seq, rank=rank, world_size=4, client_id=f"c{rank}")
    assert table.lowest_held() == {0: 4, 1: 5}
    assert table.count_by_rank() == {0: 1, 1: 3}
    assert table.world_sizes() == {4}


# ---- two live clients on one rank ---------------------------------------------------------


def test_two_live_clients_on_one_rank_are_duplicates_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table, clock = _table()
    with caplog.at_level(logging.WARNING, logger="queue_server.leases"):
        a = table.grant(0, rank=0, world_size=2, client_id="trainer-a")
        table.grant(1, rank=1, world_size=2, client_id="trainer-r1")
        clock.now += 1
        table.grant(0, rank=0, world_size=2, client_id="trainer-b")  # takes a's lease over
        assert table.claims.duplicates() == {}  # a may have died: not yet a duplicate
        clock.now += 1
        assert not table.renew(a.lease_id, "trainer-a")  # lost to b: says nothing of a
        table.grant(2, rank=0, world_size=2, client_id="trainer-a")  # a is alive after all
        assert table.claims.duplicates() == {0: ["trainer-a", "trainer-b"]}
        for _ in range(3):  # still fighting: no second warning
            clock.now += 1
            table.grant(4, rank=0, world_size=2, client_id="trainer-b")
            table.grant(4, rank=0, world_size=2, client_id="trainer-a")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    claimed = [w for w in warnings if "claimed by 2 live clients" in w]
    assert len(claimed) == 1 and "rank 0" in claimed[0] and "trainer-a, trainer-b" in claimed[0]
    # b stops: once it has been quiet for a lease TTL, a alone holds the rank.
    clock.now += 11
    table.grant(6, rank=0, world_size=2, client_id="trainer-a")
    assert table.claims.duplicates() == {}


def test_a_restarted_trainer_replacing_a_dead_one_is_no_duplicate() -> None:
    table, clock = _table()
    old = table.grant(0, rank=0, world_size=1, client_id="old")
    clock.now += 2
    assert table.renew(old.lease_id, "old")
    clock.now += 3  # old dies; its successor starts before old's leases expire
    table.grant(0, rank=0, world_size=1, client_id="new")
    for _ in range(5):
        clock.now += 1
        table.grant(1, rank=0, world_size=1, client_id="new")
    assert table.claims.duplicates() == {}


def test_claims_per_rank_stay_bounded() -> None:
    """A flood of client ids on one rank keeps the newest few, and still finds the two that
    fight over it."""
    table, clock = _table()
    for i in range(1000):
        clock.now += 0.001
        table.grant(i, rank=0, world_size=1, client_id=f"c{i}")
        table.grant(i, rank=0, world_size=1, client_id="a" if i % 2 else "b")
    assert len(table.claims._claims[0]) <= 16
    (found,) = table.claims.duplicates().values()
    assert {"a", "b"} <= set(found) and len(found) <= 16
