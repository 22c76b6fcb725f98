"""SetCurriculum on a split: alpha checked, placed at a seq every rank agrees on, journaled
before it is acknowledged, then read by the composer with each served file it composes. A
journal's alpha records are checked before they are replayed: one out of range is left out,
named, never fatal."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from queue_client import errors
from queue_server.journal.records import AlphaChange
from queue_server.steering.log import ALPHA
from queue_server.steering.port import SteeredSplit

log = logging.getLogger("queue_server.curriculum")


def valid_alpha(alpha: object) -> bool:
    return alpha is None or (
        isinstance(alpha, float) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0
    )


async def set_curriculum(
    split: SteeredSplit, alpha: float | None, position: int | None, rank: int
) -> int:
    """Change alpha (None: back to the config schedule) from a seq on; returns that seq.

    With the caller's position (the seq of the file it reads), the change starts at the
    first round of W files past any that can be composed already, so the same calls at
    the same steps give the same batches whatever the timing: within
    (max_backlog_files + 3) files of the caller's stream. Without one it starts at the next
    file not yet composed: sooner, but timing-dependent.
    """
    where = split.where
    if not split.curriculum:
        raise errors.InvalidRequest(
            f'{where} does not use selection = "curriculum" (it is '
            f"{split.config.selection!r}): set it in the dataset's config to use SetCurriculum"
        )
    if not valid_alpha(alpha):
        raise errors.InvalidRequest(f"alpha {alpha!r} for {where} is outside [0, 1]")
    if position is not None and position < 0:
        raise errors.InvalidRequest(f"position seq {position} for {where} is negative")
    async with split.steering_lock:
        if split.plane is not None:  # placed by the job's log: the same seq on every server
            return await split.plane.propose(ALPHA, alpha, position, rank)
        # Past every stream's composed files: a composer's next pick, whichever stream.
        at = split.change_point(position, split.first_unmade())
        split.append_record(AlphaChange(at, alpha, rank))
        split.alpha_overrides.append((at, alpha))
    log.info("%s: alpha %s from seq %d on", where, "schedule" if alpha is None else alpha, at)
    return at


def replayable(records: Sequence[AlphaChange]) -> tuple[list[tuple[int, float | None]], list[str]]:
    """The journal's alpha changes that can be applied, and a line naming each left out."""
    kept: list[tuple[int, float | None]] = []
    refused: list[str] = []
    for i, record in enumerate(records):
        if valid_alpha(record.alpha):
            kept.append((record.at, record.alpha))
        else:
            refused.append(
                f"curriculum change #{i + 1} of the journal (from seq {record.at}, alpha "
                f"{record.alpha!r}, rank {record.rank}) is outside [0, 1] and is left out"
            )
    return kept, refused
