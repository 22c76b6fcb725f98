"""SetCurriculum on a split: alpha checked, placed at a seq every rank agrees on, journaled
before it is acknowledged, then read by the composer with each served file it composes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from queue_client import errors
from queue_server.journal.records import AlphaChange

if TYPE_CHECKING:
    from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server.curriculum")


def set_curriculum(queue: SplitQueue, alpha: float | None, position: int | None, rank: int) -> int:
    """Change alpha (None: back to the config schedule) from a seq on; returns that seq.

    With the caller's position (the seq of the file it reads), the change starts at the
    first round of W files past any that can be composed already, so the same calls at
    the same steps give the same batches whatever the timing: within
    (max_backlog_files + 3) files of the caller's stream. Without one it starts at the next
    file not yet composed: sooner, but timing-dependent.
    """
    where = queue.where
    if not queue.curriculum:
        raise errors.InvalidRequest(
            f'{where} does not use selection = "curriculum" (it is '
            f"{queue.config.selection!r}): set it in the dataset's config to use SetCurriculum"
        )
    if alpha is not None and not (isinstance(alpha, float) and 0.0 <= alpha <= 1.0):
        raise errors.InvalidRequest(f"alpha {alpha!r} for {where} is outside [0, 1]")
    if position is not None and position < 0:
        raise errors.InvalidRequest(f"position seq {position} for {where} is negative")
    at = queue.production.earliest_unmade()
    if position is not None:
        at = queue.schedule.change_point(position, at)
    queue._journal(AlphaChange(at, alpha, rank))
    queue.alpha_overrides.append((at, alpha))
    log.info("%s: alpha %s from seq %d on", where, "schedule" if alpha is None else alpha, at)
    return at
