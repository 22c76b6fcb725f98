"""A split's stats as one frozen-in-time record: what GetStats, the CLI and /metrics show."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from queue_server.split_state import Counters

if TYPE_CHECKING:
    from queue_server.split_queue import SplitQueue


@dataclass
class RankView:
    rank: int
    last_consumed_seq: int
    files_leased: int
    lag_files: int


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
    last_disk_error: str = ""
    curriculum: dict[str, Any] | None = None
    seqs_produced: int = 0
    seqs_consumed: int = 0
    seqs_quarantined: int = 0
    seqs_missing: int = 0


def snapshot(queue: SplitQueue) -> SplitSnapshot:
    schedule, state = queue.schedule, queue.state
    w = schedule.world_size
    leased = queue.leases.count_by_rank()
    lag: dict[int, int] = {}
    for seq in state.files:
        lag[seq % w] = lag.get(seq % w, 0) + 1
    # A node-local server shows its own ranks only.
    shown = range(w) if queue.served.all else sorted(queue.served.ranks or ())
    ranks = [
        RankView(r, schedule.last_consumed.get(r, -1), leased.get(r, 0), lag.get(r, 0))
        for r in shown
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
        ready_files=len(state.files) - len(queue.leases),
        leased_files=len(queue.leases),
        max_backlog_files=schedule.max_backlog_files,
        world_size=w,
        next_seq=queue.production.next_seq(),
        ranks=ranks,
        worker_pids=queue.worker_pids(),
        last_disk_error=state.last_disk_error or backend.get("last_disk_error", ""),
        curriculum=curriculum,
        **state.accounting(),
    )
