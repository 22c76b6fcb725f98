"""Start-up: make a split's directory agree with its journal before anything is served.

Temp files are leftovers of interrupted writes. A published file the journal does not know
(the server died between the rename and the journal line) or knows under another name (made
again since) is removed: it is produced again, identically, if anyone asks, so removing it
loses nothing. What is left is exactly the journal's view of the disk.
"""

from __future__ import annotations

from pathlib import Path

from queue_client.batchfile import scan_queue
from queue_client.layout import remove_temp_files
from queue_server.journal import Journal, JournalSummary
from queue_server.split_state import FileEntry, SplitState


def reconcile(
    directory: Path, quarantine: Path, journal: Journal, state: SplitState
) -> JournalSummary:
    """Fill `state` from the journal and the directory; returns the journal's summary."""
    directory.mkdir(parents=True, exist_ok=True)
    quarantine.mkdir(parents=True, exist_ok=True)
    remove_temp_files(directory)
    summary = journal.replay()
    c = state.counters
    c.produced_files, c.reproduced_files = summary.produced_count, summary.reproduced_count
    c.consumed_files, c.quarantined_files = summary.consumed_count, summary.quarantined_count
    c.produced_bytes = summary.produced_bytes
    state.offsets = dict(summary.offsets)
    state.advanced = dict(summary.advanced)
    state.consumed = set(summary.consumed)
    state.quarantined = set(summary.quarantined)
    for name in scan_queue(directory):
        rec = summary.produced.get(name.seq)
        if rec is not None and rec.name == str(name) and name.seq not in state.files:
            state.files[name.seq] = FileEntry(name.seq, rec.name, rec.size_bytes, rec.crc32)
        else:
            (directory / str(name)).unlink(missing_ok=True)
            c.orphans_removed += 1
    return summary
