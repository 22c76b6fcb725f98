"""The production planner on its own: which seq each slot makes, publishes or passes through.

Each test runs the planner to quiescence: every slot takes jobs until none is due, and each
job completes at once (a published file lands on disk, an advanced seq is journaled).
"""

from __future__ import annotations

from queue_server.config.served_ranks import ServedRanks
from queue_server.production.planner import Job, Planner
from queue_server.split.schedule import DETERMINISTIC, Schedule
from queue_server.split.state import FileEntry, SplitState

NODE = ServedRanks(frozenset({2, 3}), world_size=4)  # the second node of two, 2 ranks each


def planner(
    slots: int,
    *,
    stateful: bool,
    served: ServedRanks = NODE,
    world_size: int = 4,
    can_advance: bool = True,
) -> Planner:
    schedule = Schedule(DETERMINISTIC, max_backlog_files=2, world_size=world_size, served=served)
    plan = Planner(slots, schedule, SplitState(), can_advance=can_advance)
    plan.stateful = stateful
    return plan


def run(plan: Planner, held: dict[int, int] | None = None) -> list[tuple[int, Job]]:
    """(slot, job) in the order given, until no slot has a job due."""
    done: list[tuple[int, Job]] = []
    while True:
        progressed = False
        for slot in range(plan.slots):
            job = plan.next_job(slot, held or {}, unleased_files=0)
            if job is None:
                continue
            plan.started(job)
            plan.finished(job, slot, journaled=True)
            if job.publish:
                plan.state.offsets[job.seq] = 0
                plan.state.files[job.seq] = FileEntry(job.seq, f"{job.seq}.pt", 1, 0)
            else:
                plan.state.advanced[job.seq] = 0
            done.append((slot, job))
            progressed = True
        if not progressed:
            return done


def published(jobs: list[tuple[int, Job]]) -> list[int]:
    return sorted(job.seq for _, job in jobs if job.publish)


def test_a_stateless_node_makes_only_its_ranks_windows() -> None:
    jobs = run(planner(1, stateful=False))
    # Ranks 2 and 3 of 4, four files each (reading, prefetched, a backlog of two).
    assert [job.seq for _, job in jobs] == [2, 3, 6, 7, 10, 11, 14, 15]
    assert all(job.publish and not job.again for _, job in jobs)


def test_a_streaming_node_passes_its_stream_through_the_other_ranks_seqs() -> None:
    jobs = run(planner(2, stateful=True))
    assert published(jobs) == [2, 3, 6, 7, 10, 11, 14, 15]
    passed = sorted(job.seq for _, job in jobs if not job.publish)
    assert passed == [0, 1, 4, 5, 8, 9, 12, 13]
    for slot in range(2):  # each slot visits every one of its seqs, in order, and no more
        assert [job.seq for s, job in jobs if s == slot] == list(range(slot, 16, 2))


def test_a_carried_seq_of_another_rank_is_made_anyway() -> None:
    stateless = planner(1, stateful=False)
    run(stateless)
    stateless.want(9, explicit=True)  # rank 1's: no node-local forward stream here makes it
    assert run(stateless) == [(0, Job(9, again=True))]

    streaming = planner(2, stateful=True)
    run(streaming)
    streaming.want(21, explicit=True)  # ahead of the stream: it must get there
    jobs = run(streaming)
    # 19 is rank 3's but outside its window: passed now, made from its state when asked.
    assert [(job.seq, job.publish) for _, job in jobs] == [(17, False), (19, False), (21, True)]
    streaming.want(19)
    assert run(streaming) == [(1, Job(19, again=True))]


def test_a_rank_own_seq_ahead_waits_for_its_window() -> None:
    plan = planner(1, stateful=False)
    run(plan)
    plan.want(18)  # rank 2's next file but one: forward production reaches it in the window
    assert not plan.reproduce and not plan.wanted


def test_a_stream_resumed_far_ahead_passes_what_was_read_without_files() -> None:
    every = ServedRanks()
    plan = planner(1, stateful=True, served=every, world_size=1)
    plan.schedule.note_request(0, 10, pin=False)  # a checkpoint at seq 10, on a fresh server
    jobs = run(plan)
    assert [job.seq for _, job in jobs if not job.publish] == list(range(10))
    assert published(jobs) == [10, 11, 12, 13, 14]  # its window, from the seq it waits for
    # A curriculum composer cannot pass a file without serving it: the old behaviour.
    composer = planner(1, stateful=True, served=every, world_size=1, can_advance=False)
    composer.schedule.note_request(0, 10, pin=False)
    assert published(run(composer)) == list(range(15))


def test_one_server_for_every_rank_makes_every_window() -> None:
    jobs = run(planner(2, stateful=False, served=ServedRanks(), world_size=2))
    assert published(jobs) == list(range(8))


def test_the_seq_a_rank_waits_for_is_made_first() -> None:
    """A trainer asks for its first file before any slot runs: that seq is made first, not
    after the files behind it in its window (its rank's frontier is already past it)."""
    every = ServedRanks()
    plan = planner(2, stateful=False, served=every, world_size=1)
    plan.schedule.note_request(0, 0, pin=False)  # rank 0 waits for seq 0
    plan.want(0)
    first = run(plan)[:2]
    assert [job for _, job in first] == [Job(0), Job(1)]
    # A rank that resumes far ahead (a checkpoint) and waits there: the slots jump to the
    # seq it waits for, not to the one after it.
    plan.schedule.note_request(0, 30, pin=False)
    assert [job.seq for _, job in run(plan)][:2] == [30, 31]
