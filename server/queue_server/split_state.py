"""The facts of one split that its owner, its production and its stats share.

Plain data, changed only on the event loop: which files are on disk, which seqs were ever
produced (with where their journal record starts), consumed or quarantined, and the counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FileEntry:
    """A published file of the split, ready or leased."""

    seq: int
    name: str
    size_bytes: int
    crc32: int


@dataclass
class Counters:
    produced_files: int = 0
    reproduced_files: int = 0
    consumed_files: int = 0
    quarantined_files: int = 0
    produced_bytes: int = 0
    leases_expired: int = 0
    worker_restarts: int = 0
    orphans_removed: int = 0
    disk_errors: int = 0


@dataclass
class SplitState:
    files: dict[int, FileEntry] = field(default_factory=dict)
    # seq -> journal offset of its latest produced record (kept after consumption, so the
    # seq can be made again from its journaled state).
    offsets: dict[int, int] = field(default_factory=dict)
    # seq -> journal offset of its advanced record: made by a streaming slot to move past a
    # seq no rank here reads, no file written. Not produced: the stats never count it.
    advanced: dict[int, int] = field(default_factory=dict)
    consumed: set[int] = field(default_factory=set)
    quarantined: set[int] = field(default_factory=set)
    # Seqs whose file is being deleted or moved to quarantine: production waits for them.
    leaving: set[int] = field(default_factory=set)
    counters: Counters = field(default_factory=Counters)
    last_error: str = ""
    last_disk_error: str = ""

    def accounting(self) -> dict[str, int]:
        """Every seq ever produced is on disk, consumed, quarantined or missing."""
        produced = set(self.offsets)
        on_disk = set(self.files)
        consumed = (self.consumed & produced) - on_disk
        quarantined = (self.quarantined & produced) - on_disk - consumed
        missing = produced - on_disk - consumed - quarantined
        return {
            "seqs_produced": len(produced),
            "seqs_consumed": len(consumed),
            "seqs_quarantined": len(quarantined),
            "seqs_missing": len(missing),
        }
