"""The resume and elastic rules as pure functions: exactly-once over small exhaustive grids."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_client.errors import InvalidRequest
from queue_client.streaming.resume import StreamPlan, elastic_plan, plan_resume
from queue_client.world import World

NB = 4  # batches per file


def read(plan: StreamPlan, stride: int, batches: int) -> tuple[list[tuple[int, int]], StreamPlan]:
    """Simulate a client reading `batches` batches; returns the (seq, offset) read and the plan left."""
    items, next_seq = list(plan.items), plan.next_seq
    out = []
    while len(out) < batches:
        if not items:
            items.append((next_seq, 0))
            next_seq += stride
        seq, offset = items[0]
        out.append((seq, offset))
        items[0] = (seq, offset + 1)
        if offset + 1 == NB:
            items.pop(0)
    return out, StreamPlan(tuple(items), next_seq).normalized(stride)


def state_of(plan: StreamPlan, rank: int, world: int) -> dict:
    return {
        "version": 1,
        "dataset": "d",
        "rank": rank,
        "world_size": world,
        "splits": {"train": plan.to_state(world)},
    }


@pytest.mark.parametrize("old_w", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("new_w", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("steps", [0, 1, 3, 4, 7, 9])
def test_elastic_resume_is_exactly_once(old_w: int, new_w: int, steps: int) -> None:
    """Lockstep ranks read `steps` batches each, resume at another world size, and together
    read every batch below a bound exactly once."""
    consumed: list[tuple[int, int]] = []
    states = []
    for r in range(old_w):
        got, left = read(StreamPlan((), r), old_w, steps)
        consumed += got
        states.append(state_of(left, r, old_w))
    bound = 6 * old_w * new_w
    for r in range(new_w):
        plan = plan_resume(states, World(r, new_w), "d")["train"]
        got, _ = read(plan, new_w, (bound + NB) * NB)
        consumed += got
    counts = Counter(consumed)
    assert max(counts.values()) == 1
    below = {k for k in counts if k[0] < bound}
    assert below == {(s, i) for s in range(bound) for i in range(NB)}


@settings(max_examples=60, deadline=None)
@given(
    old_w=st.integers(1, 6),
    new_w=st.integers(1, 6),
    steps=st.integers(0, 12),
    lead=st.integers(0, 3),
)
def test_elastic_resume_from_uneven_ranks(old_w: int, new_w: int, steps: int, lead: int) -> None:
    """Ranks that read different amounts (not lockstep), given as a list, still come out exactly once."""
    consumed, states = [], []
    for r in range(old_w):
        got, left = read(StreamPlan((), r), old_w, steps + (lead if r == 0 else 0))
        consumed += got
        states.append(state_of(left, r, old_w))
    bound = 4 * old_w * new_w
    for r in range(new_w):
        got, _ = read(
            plan_resume(states, World(r, new_w), "d")["train"], new_w, (bound + 2 * NB + lead) * NB
        )
        consumed += got
    counts = Counter(consumed)
    assert max(counts.values()) == 1
    assert {k for k in counts if k[0] < bound} == {(s, i) for s in range(bound) for i in range(NB)}


def test_same_world_resume_is_the_saved_plan() -> None:
    _, left = read(StreamPlan((), 1), 2, 6)
    state = state_of(left, 1, 2)
    assert state["splits"]["train"] == {"seq": 3, "offset": 2, "next_seq": 5, "pending": []}
    assert plan_resume(state, World(1, 2), "d")["train"] == StreamPlan(((3, 2),), 5)


def test_one_lockstep_state_gives_every_rank_its_plan() -> None:
    state = state_of(read(StreamPlan((), 2), 4, 5)[1], 2, 4)
    states = [state_of(read(StreamPlan((), r), 4, 5)[1], r, 4) for r in range(4)]
    for r in range(2):
        assert plan_resume(state, World(r, 2), "d") == plan_resume(states, World(r, 2), "d")


def test_elastic_boundary_is_a_multiple_of_both_world_sizes() -> None:
    old = [StreamPlan(((r, 1),), r + 3) for r in range(3)]
    plan = elastic_plan(old, 3, World(0, 2))
    assert plan.next_seq % 6 == 0


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({}, "lacks keys"),
        ({"version": 9, "dataset": "d", "rank": 0, "world_size": 1, "splits": {}}, "version 9"),
        (
            {"version": 2, "dataset": "d", "rank": 0, "world_size": 1, "splits": {}},
            r"version 2 lacks keys \['config_fingerprint'\]",
        ),
        ({"version": 1, "dataset": "e", "rank": 0, "world_size": 1, "splits": {}}, "dataset 'e'"),
        (
            {
                "version": 1,
                "dataset": "d",
                "rank": 0,
                "world_size": 1,
                "splits": {"train": {"seq": -1, "offset": 0, "next_seq": 1}},
            },
            "seq is -1",
        ),
        (
            {
                "version": 1,
                "dataset": "d",
                "rank": 0,
                "world_size": 1,
                "splits": {"train": {"seq": 0, "offset": 0, "next_seq": 1, "pending": [[1]]}},
            },
            "pending item",
        ),
        ({"version": 1, "dataset": "d", "rank": 3, "world_size": 2, "splits": {}}, "rank 3"),
    ],
)
def test_bad_states_are_refused_with_a_reason(state: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        plan_resume(state, World(0, 1), "d")


def test_overlapping_states_are_refused() -> None:
    a = state_of(StreamPlan(((0, 1),), 2), 0, 2)
    b = state_of(StreamPlan(((0, 2),), 3), 1, 2)
    with pytest.raises(InvalidRequest, match="overlap"):
        plan_resume([a, b], World(0, 3), "d")


def _v2(train: dict, fingerprint: str = "f00d") -> dict:
    return {
        "version": 2,
        "dataset": "d",
        "config_fingerprint": fingerprint,
        "rank": 0,
        "world_size": 1,
        "splits": {"train": train},
    }


@pytest.mark.parametrize(
    ("state", "message"),
    [
        # (state, what the refusal names), against a server of fingerprint f00d, 4 batches a file
        (_v2({"seq": 0, "offset": 0, "next_seq": 1}, "beef"), "'beef', but the server .* 'f00d'"),
        (_v2({"seq": 3, "offset": 5, "next_seq": 4}), "seq 3 at offset 5, but a file holds 4"),
        (
            _v2({"seq": 3, "offset": 1, "next_seq": 5, "pending": [[4, 9]]}),
            "seq 4 at a pending offset 9",
        ),
    ],
)
def test_a_state_of_another_config_or_past_a_files_end_is_refused(
    state: dict, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        plan_resume(state, World(0, 1), "d", fingerprint="f00d", batches_per_file=NB)


def test_a_state_names_what_it_was_saved_under_and_older_states_still_load() -> None:
    plan = StreamPlan(((3, 4),), 4)  # at a file's very end: nothing left in it, but valid
    mine = _v2(plan.to_state(1))
    assert plan_resume(mine, World(0, 1), "d", fingerprint="f00d", batches_per_file=NB) == {
        "train": plan
    }
    old = {k: v for k, v in mine.items() if k != "config_fingerprint"} | {"version": 1}
    assert plan_resume(old, World(0, 1), "d", fingerprint="f00d", batches_per_file=NB) == {
        "train": plan
    }
