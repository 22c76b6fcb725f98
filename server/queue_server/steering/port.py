"""The narrow view of a split that SetMixture and SetCurriculum work through. SplitQueue
implements it; the changes modules import this, never SplitQueue (no arrow back up)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from queue_server.config.server import DatasetConfig
from queue_server.journal.records import AlphaChange, MixtureChange, StepSkip

if TYPE_CHECKING:
    from queue_server.mixture.stats import MixtureView
    from queue_server.split.schedule import Schedule


class SharedChanges(Protocol):
    """The job's control plane as a change sees it (steering/plane.py's SplitPlane): where
    changes are placed, and how one is made on every server."""

    @property
    def horizon(self) -> int:
        """The highest seq any server of the job may have made."""
        ...

    async def propose(
        self,
        kind: str,
        value: Any,
        position: int | None,
        rank: int,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Make a change on every server; returns its first seq."""
        ...


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

    @property
    def plane(self) -> SharedChanges | None:
        """The job's control plane, where servers share their changes (None: none)."""
        ...

    def first_unmade(self) -> int:
        """The first seq past every seq made or being made (a change may start there)."""
        ...

    def change_point(self, position: int | None, earliest: int) -> int:
        """The seq a change starts at: from the caller's position, never before `earliest`."""
        ...

    def append_record(self, record: AlphaChange | MixtureChange | StepSkip) -> None:
        """Journal the change before it takes effect (ServerUnavailable if it cannot be)."""
        ...
