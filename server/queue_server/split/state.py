"""The facts of one split that its owner, its production and its stats share.

Plain data, changed only on the event loop: which files are on disk, which seqs were ever
produced (with where their journal record starts), consumed or quarantined, and the counters.
Seqs below the compaction floor are counted in `folded` instead of listed, so memory does not
grow with the files served.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from queue_server.journal.records import Folded


@dataclass
class FileEntry:
    """A published file of the split, ready or leased."""

    seq: int
    name: str
    size_bytes: int
    crc32: int


@dataclass(frozen=True)
class KeptRelease:
    """A CONSUMED release the journal had no room for, journaled once it has (removal.py)."""

    lease_id: str
    client_id: str
    rank: int
    world_size: int


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
    # The journal cannot be written (a disk error, path and errno text) or was lost (deleted
    # or cut under the server): the split hands out nothing until this is "" again.
    journal_error: str = ""
    # seq -> a CONSUMED release of it that could not be journaled: journaled once the journal
    # can be written again (the file stays on disk until then).
    kept_releases: dict[int, KeptRelease] = field(default_factory=dict)
    # rank -> its files on disk when the split opened, not leased since: those it may have
    # read before a restart without the release reaching the journal (read_past.py). Ranks
    # and seqs under the journal's world size at opening, `read_past_world`.
    read_past_candidates: dict[int, set[int]] = field(default_factory=dict)
    read_past_world: int = 0
    # Seconds the next restart of a failing worker waits (0: none failing).
    worker_backoff_s: float = 0.0
    # Compaction: seqs below floor (read by their rank already) are only counted, in folded;
    # states_only maps such a seq to the journal record it can be made again from (a rewind).
    floor: int = 0
    folded: Folded = field(default_factory=Folded)
    states_only: dict[int, int] = field(default_factory=dict)
    # slot -> (its last forward seq, offset of that record): its stream resumes from it.
    last_forward: dict[int, tuple[int, int]] = field(default_factory=dict)

    def accounting(self) -> dict[str, int]:
        """Every seq ever produced is on disk, consumed, quarantined or missing."""
        produced = set(self.offsets)
        on_disk = set(self.files)
        consumed = (self.consumed & produced) - on_disk
        quarantined = (self.quarantined & produced) - on_disk - consumed
        missing = produced - on_disk - consumed - quarantined
        f = self.folded
        return {
            "seqs_produced": len(produced) + f.produced,
            "seqs_consumed": len(consumed) + f.consumed,
            "seqs_quarantined": len(quarantined) + f.quarantined,
            "seqs_missing": len(missing) + f.missing,
        }

    def state_offset(self, seq: int) -> int | None:
        """Where the journal record that can make seq again starts, if it is still kept."""
        for where in (self.offsets, self.advanced, self.states_only):
            offset = where.get(seq)
            if offset is not None:
                return offset
        return None
