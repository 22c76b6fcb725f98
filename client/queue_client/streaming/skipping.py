"""Skipped steps on the trainer's side: a split's step counter and the ranges SkipSteps removed.

A step is one get_batch call; steps [a, b) of every rank are skipped (docs/ordering.md,
"Skipping steps"). The client learns the ranges as it opens a stream (one call) and from every
lease reply after that (its background threads write them here). When the counter reaches a
range's start, or stands inside one after a resume, the stream is advanced b - step batches of
the dataset's batch size without reading them, and the counter set to b. In steady state
get_batch pays one comparison: `step >= next_at` or a changed version.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from queue_client.streaming.resume import StreamPlan
from queue_client.world import World


class StepSkips:
    """One split's step counter and skipped ranges. The lease threads call `learn`; the
    trainer's thread reads `due` and counts steps."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.ranges: tuple[tuple[int, int], ...] = ()
        self.next_at: float = math.inf  # the step at which to look again
        self.version = 0  # bumped by learn (another thread)
        self.seen = 0  # the version due() last looked at

    def learn(self, ranges: Iterable[tuple[int, int]]) -> None:
        found = tuple(sorted((int(a), int(b)) for a, b in ranges))
        if found != self.ranges:
            self.ranges = found
            self.version += 1

    def check_needed(self) -> bool:
        return self.step >= self.next_at or self.version != self.seen

    def due(self) -> int | None:
        """The step to go on at when the counter stands in a skipped range, else None; and
        the step to look again at, from now on."""
        self.seen = self.version
        target = None
        for a, b in self.ranges:  # ranges may touch or overlap: follow them to the end
            if a <= (target if target is not None else self.step) < b:
                target = b
        here = target if target is not None else self.step
        self.next_at = min((a for a, _ in self.ranges if a > here), default=math.inf)
        return target


def advanced(plan: StreamPlan, rows: int, rows_per_file: int, stride: int) -> StreamPlan:
    """The plan `rows` rows further on: its explicit files first (each from its offset), then
    the strided seqs. Pure; the rows passed over are never read."""
    items = list(plan.items)
    while items:
        seq, offset = items[0]
        left = rows_per_file - offset
        if rows < left:
            items[0] = (seq, offset + rows)
            return StreamPlan(tuple(items), plan.next_seq)
        rows -= left
        items.pop(0)
    files, offset = divmod(rows, rows_per_file)
    seq = plan.next_seq + files * stride
    if offset:
        return StreamPlan(((seq, offset),), seq + stride)
    return StreamPlan((), seq)


def passed_over(before: StreamPlan, after: StreamPlan, stride: int) -> frozenset[int]:
    """The files of `before`, in its order, up to the one `after` starts in: every row of
    theirs that was left is skipped (the client releases them as consumed)."""
    first = after.items[0][0] if after.items else after.next_seq
    out: list[int] = []
    for seq, _ in before.items:
        if seq == first:
            return frozenset(out)
        out.append(seq)
    seq = before.next_seq
    while seq < first:
        out.append(seq)
        seq += stride
    return frozenset(out)


def step_of(
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]], split: str, world: World
) -> int:
    """The step counter a resumed split starts from: this rank's own state's where the list
    holds it (same rank and world size), else the furthest of the states (ranks step
    together). 0 for states written before steps were counted."""
    states = [state] if isinstance(state, Mapping) else list(state)
    mine = [
        s for s in states if s.get("rank") == world.rank and s.get("world_size") == world.world_size
    ]
    steps = [int(s.get("splits", {}).get(split, {}).get("step", 0) or 0) for s in (mine or states)]
    return max(steps, default=0)
