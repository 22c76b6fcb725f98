"""The narrow view of a split that SetMixture and SetCurriculum work through. SplitQueue
implements it; the changes modules import this, never SplitQueue (no arrow back up)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from queue_server.config.server import DatasetConfig
from queue_server.journal.records import AlphaChange, MixtureChange, StepSkip

if TYPE_CHECKING:
    from queue_server.mixture.stats import MixtureView
    from queue_server.split.schedule import Schedule
    from queue_server.steering.plane import SplitPlane


class SteeredSplit(Protocol):
    """What a steering change reads and writes of one split."""

    where: str
    config: DatasetConfig
    mixture: bool  # a mixture split (SetMixture applies)
    curriculum: bool  # a composed split (SetCurriculum applies)
    mixture_view: MixtureView | None
    mixture_changes: list[tuple[int, dict[str, float] | None]]
    alpha_overrides: list[tuple[int, float | None]]
    skips: list[tuple[int, int]]  # SkipSteps: global steps [a, b) every rank skips
    schedule: Schedule  # which seq each rank reads (its world size, its window)
    steering_lock: asyncio.Lock  # one change at a time, each checked against those before
    plane: SplitPlane | None  # the job's control plane, where servers share their changes

    def first_unmade(self) -> int:
        """The first seq past every seq made or being made (a change may start there)."""
        ...

    def earliest_unmade(self) -> int:
        """The first seq of slot 0 not made or being made (a composer's next pick)."""
        ...

    def change_point(self, position: int | None, earliest: int) -> int:
        """The seq a change starts at: from the caller's position, never before `earliest`."""
        ...

    def append_record(self, record: AlphaChange | MixtureChange | StepSkip) -> None:
        """Journal the change before it takes effect (ServerUnavailable if it cannot be)."""
        ...
