"""Start-up: make a split's directory agree with its journal before anything is served.

Temp files are leftovers of interrupted writes (of batch files, and of a compaction or a probe
beside the journal). A published file the journal does not know (the server died between the
rename and the journal line) or knows under another name (made again since) is removed: it is
produced again, identically, if anyone asks, so removing it loses nothing. What is left is
exactly the journal's view of the disk. The files left are noted (by rank) as ones a rank may
have read before the restart without its release reaching the journal (split/read_past.py).

A missing journal beside published or quarantined files is another matter: those files would
all look unjournaled and be removed, and the split would start over as if new. The start
fails instead (JournalLost), naming the journal and the files, and nothing is touched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from queue_client.format.batchfile import scan_queue
from queue_client.format.layout import TMP_PREFIX, remove_temp_files
from queue_server.journal.file import Journal, JournalLost
from queue_server.journal.records import JournalSummary
from queue_server.split.state import FileEntry, SplitState


def check_journal_present(journal: Journal, directory: Path, quarantine: Path) -> None:
    """Raise JournalLost if the journal is missing while files that need it exist."""
    if journal.exists():
        return
    published = len(scan_queue(directory)) if directory.is_dir() else 0
    quarantined = len(scan_queue(quarantine)) if quarantine.is_dir() else 0
    if published or quarantined:
        raise JournalLost(
            f"the journal {journal.path} is missing, but {directory} holds {published} batch "
            f"file(s) and {quarantine} {quarantined} that only it accounts for (a new journal "
            "would have them removed and the split start over); nothing was touched. Restore "
            "the journal, or move the dataset aside with `queue-server reset DATASET` to "
            "rebuild it"
        )


def remove_journal_temps(journal: Journal) -> None:
    """Temp files of this journal (a compaction or a probe cut short): `.tmp-PID-N-...NAME`."""
    prefix = rf"{re.escape(TMP_PREFIX)}[0-9]+-[0-9]+-"
    name = re.compile(rf"{prefix}(?:{prefix})?{re.escape(journal.path.name)}")
    try:
        entries = os.listdir(journal.path.parent)
    except FileNotFoundError:
        return
    for entry in entries:
        if name.fullmatch(entry):
            (journal.path.parent / entry).unlink(missing_ok=True)


def fill_state(summary: JournalSummary, state: SplitState) -> None:
    """The split's memory as the journal left it."""
    c = state.counters
    c.produced_files, c.reproduced_files = summary.produced_count, summary.reproduced_count
    c.consumed_files, c.quarantined_files = summary.consumed_count, summary.quarantined_count
    c.produced_bytes = summary.produced_bytes
    state.offsets = dict(summary.offsets)
    state.advanced = dict(summary.advanced)
    state.states_only = dict(summary.states_only)
    state.last_forward = dict(summary.last_forward)
    state.consumed = set(summary.consumed)
    state.quarantined = set(summary.quarantined)
    state.floor = summary.floor
    state.folded = summary.folded


def reconcile(
    directory: Path, quarantine: Path, journal: Journal, state: SplitState
) -> JournalSummary:
    """Fill `state` from the journal and the directory; returns the journal's summary."""
    check_journal_present(journal, directory, quarantine)
    directory.mkdir(parents=True, exist_ok=True)
    quarantine.mkdir(parents=True, exist_ok=True)
    remove_temp_files(directory)
    remove_journal_temps(journal)
    summary = journal.replay()
    journal.open()
    fill_state(summary, state)
    c = state.counters
    for name in scan_queue(directory):
        rec = summary.produced.get(name.seq)
        if rec is not None and rec.name == str(name) and name.seq not in state.files:
            state.files[name.seq] = FileEntry(name.seq, rec.name, rec.size_bytes, rec.crc32)
        else:
            (directory / str(name)).unlink(missing_ok=True)
            c.orphans_removed += 1
    if summary.consumed_count:  # a release of one of them may never have reached the journal
        w = state.read_past_world = summary.world_size
        for seq in state.files:
            state.read_past_candidates.setdefault(seq % w, set()).add(seq)
    return summary


def remove_unjournaled(directory: Path, state: SplitState) -> int:
    """At a clean stop, after the workers are gone: remove the batch files no journal record
    names (a worker's file published while the stop cancelled its job, a consumed file whose
    delete the stop cut short), so that the directory is exactly the journal's view and the
    next start has nothing to clean up, even one that is then refused (a changed input).
    Returns how many it removed."""
    removed = 0  # temps of cut writes are temp_sweep.py's, once their writers are gone
    for name in scan_queue(directory):
        entry = state.files.get(name.seq)
        if entry is None or entry.name != str(name):
            (directory / str(name)).unlink(missing_ok=True)
            removed += 1
    return removed
