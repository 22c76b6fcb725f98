"""A split's stats as one frozen-in-time record: what GetStats, the CLI and /metrics show.

`snapshot` reads the queue (counters, files, leases, ranks); `training_view` turns consumed
files and a consumption rate into training terms (tokens/s, batches/s, epochs, ETA).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from queue_server.config.served_ranks import ServedRanks
from queue_server.mixture.stats import MixtureView
from queue_server.production.backend import WorkerPlace
from queue_server.production.producer import Production
from queue_server.split.leases import LeaseTable
from queue_server.split.schedule import Schedule
from queue_server.split.state import Counters, SplitState
from queue_server.split.training_units import SplitUnits


class ShownSplit(Protocol):
    """What a split's stats read of it (SplitQueue implements it)."""

    split: str
    curriculum: bool  # a composed split: its composer's figures are shown
    state: SplitState
    schedule: Schedule
    leases: LeaseTable
    served: ServedRanks
    production: Production
    mixture_view: MixtureView | None
    mixture_changes: list[tuple[int, dict[str, float] | None]]
    alpha_overrides: list[tuple[int, float | None]]

    def worker_pids(self) -> list[int]: ...

    def workers(self) -> list[WorkerPlace]: ...


@dataclass
class RankView:
    rank: int
    last_consumed_seq: int
    files_leased: int
    lag_files: int
    # Files of this rank on disk and not leased: its backlog.
    ready_files: int = 0
    # Live clients acting for this rank together, when more than one.
    duplicate_clients: list[str] = field(default_factory=list)


@dataclass
class SplitSnapshot:
    split: str
    counters: Counters
    ready_files: int
    leased_files: int
    max_backlog_files: int
    world_size: int
    next_seq: int
    ranks: list[RankView] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)
    workers: list[WorkerPlace] = field(default_factory=list)
    last_disk_error: str = ""
    journal_error: str = ""
    worker_backoff_s: float = 0.0
    last_worker_error: str = ""
    curriculum: dict[str, Any] | None = None
    mixture: dict[str, Any] | None = None
    seqs_produced: int = 0
    seqs_consumed: int = 0
    seqs_quarantined: int = 0
    seqs_missing: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrainingView:
    tokens_per_s: float
    batches_per_s: float
    rate_window_s: float
    tokens_served: int
    tokens_per_file: int
    # Epochs served and seconds to the end of the current one; None when unknown.
    epochs: float | None
    epoch_eta_s: float | None


def snapshot(queue: ShownSplit) -> SplitSnapshot:
    schedule, state = queue.schedule, queue.state
    w = schedule.world_size
    leased = queue.leases.count_by_rank()
    lag: dict[int, int] = {}
    ready: dict[int, int] = {}
    for seq in state.files:  # the files on disk: a few per rank, bounded by the windows
        lag[seq % w] = lag.get(seq % w, 0) + 1
        if queue.leases.holder(seq) is None:
            ready[seq % w] = ready.get(seq % w, 0) + 1
    ready_files = len(state.files) - len(queue.leases)
    duplicates = queue.leases.claims.duplicates()
    # A node-local server shows its own ranks only.
    shown = range(w) if queue.served.all else sorted(queue.served.ranks or ())
    ranks = [
        RankView(
            r,
            schedule.last_consumed.get(r, -1),
            leased.get(r, 0),
            lag.get(r, 0),
            ready.get(r, 0) if schedule.deterministic else ready_files,
            duplicates.get(r, []),
        )
        for r in shown
    ]
    warnings = [
        f"rank {r} is claimed by {len(ids)} live clients at once ({', '.join(ids)}): they take "
        "each other's leases; give each trainer process its own rank (RANK, WORLD_SIZE)"
        for r, ids in sorted(duplicates.items())
    ]
    backend = queue.production.backend.stats() or {}
    # A curriculum split's candidate providers are its own workers too.
    counters = dataclasses.replace(
        state.counters,
        worker_restarts=state.counters.worker_restarts + backend.get("worker_restarts", 0),
        disk_errors=state.counters.disk_errors + backend.get("disk_errors", 0),
    )
    curriculum = None
    if queue.curriculum:
        curriculum = dict(backend.get("curriculum") or {})
        curriculum["overrides"] = len(queue.alpha_overrides)
    return SplitSnapshot(
        split=queue.split,
        counters=counters,
        ready_files=ready_files,
        leased_files=len(queue.leases),
        max_backlog_files=schedule.max_backlog_files,
        world_size=w,
        next_seq=queue.production.next_seq(),
        ranks=ranks,
        worker_pids=queue.worker_pids(),
        workers=queue.workers(),
        last_disk_error=state.last_disk_error or backend.get("last_disk_error", ""),
        journal_error=state.journal_error,
        worker_backoff_s=state.worker_backoff_s,
        last_worker_error=state.last_error,
        curriculum=curriculum,
        mixture=mixture_stats(queue),
        warnings=warnings,
        **state.accounting(),
    )


def training_view(
    consumed_files: int, units: SplitUnits, files_per_s: float, window_s: float
) -> TrainingView:
    """Rates and epoch progress from consumed files and their rate (files per second)."""
    epochs: float | None = None
    eta: float | None = None
    per_file = units.per_file()
    if units.epoch_size and per_file > 0:
        epochs = consumed_files * per_file / units.epoch_size
        units_per_s = files_per_s * per_file
        if units_per_s > 0:
            left = (math.floor(epochs) + 1 - epochs) * units.epoch_size
            eta = left / units_per_s
    return TrainingView(
        tokens_per_s=files_per_s * units.tokens_per_file,
        batches_per_s=files_per_s * units.batches_per_file,
        rate_window_s=window_s,
        tokens_served=consumed_files * units.tokens_per_file,
        tokens_per_file=units.tokens_per_file,
        epochs=epochs,
        epoch_eta_s=eta,
    )


async def prepare_stats(queue: ShownSplit) -> None:
    """What a snapshot would otherwise compute on the event loop, done in a thread first (a
    mixture's schedule simulation after a weight change, its epoch records' listing)."""
    if queue.mixture_view is not None:
        await asyncio.to_thread(queue.mixture_view.prepare, list(queue.mixture_changes))


def mixture_stats(queue: ShownSplit) -> dict | None:
    """A mixture split's per-source counts (mixture/stats.py), from its consumed files."""
    if queue.mixture_view is None:
        return None
    consumed = queue.state.counters.consumed_files
    return queue.mixture_view.stats(queue.mixture_changes, consumed)
