"""A split's start: opened from what is on disk, then let serve, its workers started once.

restore: its directory made to agree with its journal (journal/reconcile.py), a long journal
compacted, and what the journal says carried on: the clients' world size and each rank's last
consumed seq (the schedule), SetCurriculum and SetMixture changes, and the seq each slot makes
next (production). StartGate: acquire waits until the dataset checked its inputs against meta,
and a lazy split's workers start on its first acquire (dataset.py decides which are lazy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from queue_server.config.served_ranks import ServedRanks
from queue_server.curriculum import changes as curriculum_changes
from queue_server.journal.file import Journal, JournalLost
from queue_server.journal.keeper import JournalKeeper
from queue_server.journal.reconcile import reconcile
from queue_server.journal.records import AlphaChange, MixtureChange, StepSkip
from queue_server.mixture import changes as mixture_changes
from queue_server.production.producer import Production
from queue_server.split.state import SplitState
from queue_server.steering import skips as step_skips
from queue_server.steering.port import SteeredSplit

log = logging.getLogger("queue_server.split")


class OpenedSplit(SteeredSplit, Protocol):
    """What opening a split reads and sets of it (SplitQueue implements it): its folders and
    journal, the state they restore, and the steering changes replayed (SteeredSplit)."""

    dir: Path
    quarantine: Path
    journal: Journal
    keeper: JournalKeeper
    state: SplitState
    served: ServedRanks
    production: Production
    reconciled: bool  # set once the journal and the directory were read


async def restore(queue: OpenedSplit) -> None:
    """Reconcile the directory with the journal (in a thread), then carry its state on.

    A missing journal beside files it accounts for (JournalLost) is recorded as the split's
    journal error and raised: nothing is served from a directory no journal explains."""
    where, schedule, served = queue.where, queue.schedule, queue.served
    try:
        summary = await asyncio.to_thread(
            reconcile, queue.dir, queue.quarantine, queue.journal, queue.state
        )
    except JournalLost as exc:
        queue.state.journal_error = str(exc)
        log.error("%s: %s", where, exc)
        raise
    queue.reconciled = True
    keeper = queue.keeper
    facts = keeper.facts
    facts.world_size, facts.last_consumed = summary.world_size, dict(summary.last_consumed)
    facts.alpha_changes, facts.records = list(summary.alpha_changes), summary.records
    if keeper.compact_records and summary.records >= keeper.compact_records:
        try:
            await asyncio.to_thread(keeper.compact_now)
        except OSError as exc:  # a long journal still replays: serve, compact later
            log.warning("%s: journal compaction at start failed: %s", where, exc)
    journaled = summary.world_size if summary.consumed_count else None
    if served.all:  # the clients' world size, as the journal last saw it
        schedule.world_size = journaled or served.world_size or 1
        schedule.last_consumed = dict(summary.last_consumed)
    elif journaled == served.world_size:  # a fixed world: positions in another lapse
        schedule.last_consumed = dict(summary.last_consumed)
    await replay_changes(queue, summary.alpha_changes)
    queue.production.resume(summary.last_forward)


async def replay_changes(
    queue: OpenedSplit, changes: list[AlphaChange | MixtureChange | StepSkip]
) -> None:
    """The journal's SetCurriculum and SetMixture changes, each checked with the code that
    applies it (in a thread: a mixture's schedule is simulated). A record that cannot be
    applied is left out and named in the log and the split's last error: the dataset serves
    on, since no file past its seq could have been made with it."""
    queue.skips, refused = step_skips.replayable([c for c in changes if isinstance(c, StepSkip)])
    alphas = [c for c in changes if isinstance(c, AlphaChange)]
    mixes = [c for c in changes if isinstance(c, MixtureChange)]
    queue.alpha_overrides, more_refused = curriculum_changes.replayable(alphas)
    refused += more_refused
    if mixes:
        queue.mixture_changes, more = await asyncio.to_thread(
            mixture_changes.replayable, queue, mixes
        )
        refused += more
    for line in refused:
        log.error("%s: %s (journal %s)", queue.where, line, queue.journal.path)
        queue.state.last_error = line


class StartGate:
    """Whether a split may hand out files yet, and whether its workers were started."""

    def __init__(self, gated: bool, on_first_acquire: Callable[[], None]) -> None:
        # Set once the dataset may hand out this split's files (its inputs were checked);
        # `gated` leaves it to the dataset, else it is set from the start. Acquire waits on it.
        self.allowed = asyncio.Event()
        if not gated:
            self.allowed.set()
        self._on_first_acquire: Callable[[], None] | None = on_first_acquire
        self.production_started = False

    @property
    def passed(self) -> bool:
        """Serving is allowed and the first acquire was announced: acquire goes straight on."""
        return self.allowed.is_set() and self._on_first_acquire is None

    def first_acquire(self) -> None:
        """Announce the first acquire, once: a lazy split's production starts then."""
        first, self._on_first_acquire = self._on_first_acquire, None
        if first is not None:
            first()
