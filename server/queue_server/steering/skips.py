"""SkipSteps on a split: global steps [a, b) removed from every rank's stream (the steps after a
loss spike), journaled before the call is answered and carried in every Lease, so each rank's
client skips them when its step counter gets there, also after a resume.

A rank learns the skips in the reply of its next lease. So a skip may only start at a step no
rank can reach before leasing another file: past the caller's file and a whole window of files
after it (the rule that places SetMixture), in steps of the dataset's batches:

    earliest = position_step + batches_per_file * (at // W - position // W)

where `at` is the seq a SetMixture from the same position would start at (the window rule,
and every claim of the job's control plane). An earlier start is refused, naming `earliest`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from queue_client import errors
from queue_server.journal.records import StepSkip
from queue_server.steering.log import SKIP
from queue_server.steering.port import SteeredSplit

log = logging.getLogger("queue_server.steering")

MAX_STEP = 999_999_999_999


def earliest_step(
    at: int, position: int | None, position_step: int, world_size: int, batches_per_file: int
) -> int:
    """The first step a skip may start at, for a change placed at seq `at` (module doc). A
    caller without a position is taken to have read its stream from step 0 on the plain stride."""
    w = max(1, world_size)
    if position is None:
        return (at // w) * batches_per_file
    return position_step + batches_per_file * (at // w - position // w)


def check_range(where: str, a: int, b: int) -> None:
    if not (0 <= a < b <= MAX_STEP):
        raise errors.InvalidRequest(
            f"SkipSteps for {where}: steps [{a}, {b}) are not a range: expected "
            f"0 <= from_step < to_step <= {MAX_STEP}"
        )


def too_early(where: str, a: int, earliest: int) -> str:
    return (
        f"SkipSteps for {where}: step {a} may already be in a file some rank has leased; the "
        f"earliest step that can be skipped now is {earliest} (the caller's file and a window "
        "of max_backlog_files + 2 files after it come first)"
    )


async def skip_steps(
    split: SteeredSplit,
    a: int,
    b: int,
    position_step: int,
    position: int | None,
    rank: int,
) -> list[tuple[int, int]]:
    """Skip global steps [a, b) on every rank; returns every skip of the split in force."""
    check_range(split.where, a, b)
    bpf = split.config.batches_per_file
    async with split.steering_lock:
        if split.plane is not None:  # placed and checked by the job's log, on every server
            extra = {"position_step": position_step, "batches_per_file": bpf}
            await split.plane.propose(SKIP, [a, b], position, rank, extra)
            return list(split.skips)
        at = split.change_point(position, split.first_unmade())
        w = split.schedule.world_size
        earliest = earliest_step(at, position, position_step, w, bpf)
        if a < earliest:
            raise errors.InvalidRequest(too_early(split.where, a, earliest))
        split.append_record(StepSkip(a, b, rank))
        split.skips.append((a, b))
    log.info("%s: steps [%d, %d) skipped on every rank (rank %d asked)", split.where, a, b, rank)
    return list(split.skips)


def replayable(records: Sequence[StepSkip]) -> tuple[list[tuple[int, int]], list[str]]:
    """The journal's skips that can be applied, and a line naming each left out."""
    kept: list[tuple[int, int]] = []
    refused: list[str] = []
    for i, record in enumerate(records):
        if 0 <= record.at < record.to <= MAX_STEP:
            kept.append((record.at, record.to))
        else:
            refused.append(
                f"step skip #{i + 1} of the journal ([{record.at}, {record.to}), rank "
                f"{record.rank}) is not a range of steps and is left out"
            )
    return kept, refused
