"""Journal compaction: fold what no restart needs into one snapshot record, so that restart
time does not grow with the files served.

A compacted journal is a snapshot record (journal.Snapshot: counts, the consumed and
quarantined seqs still listed, the seqs on disk, world size, SetCurriculum calls, and the
floor below which seqs are only counted), then the records it keeps, copied as they were:
every seq at or above the floor or on disk (their files and states), each slot's last forward
record (the stream resumes from it), and the states of up to `keep_seqs` seqs below the floor
that a rewind may ask for again (a streaming provider's; a stateless provider's records carry
no state and are dropped). The floor is the lowest seq some rank has not read yet.

Three steps, so that a crash at any point leaves a journal that replays to the same state:
plan (on the event loop: which records to keep), write (in a thread: the snapshot and the kept
records into a temp file, through layout.atomic_write, fsynced), swap (on the event loop: the
lines appended meanwhile are copied after them and the temp file is renamed over the journal in
one step). Before the rename the old journal is whole; after it, the new one is. The server's
memory is then folded the same way (apply), and a read of a moved record retries (StaleOffset).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from queue_client.format.layout import atomic_write, temp_path
from queue_server.journal.file import Journal
from queue_server.journal.records import (
    Advanced,
    AlphaChange,
    Folded,
    MixtureChange,
    Produced,
    Snapshot,
    StepSkip,
    encode,
)
from queue_server.split.state import SplitState


@dataclass
class Facts:
    """What the journal says beyond the split's state: the clients' world size, each rank's
    last consumed seq under it, the SetCurriculum calls; and records since the last snapshot."""

    world_size: int = 1
    last_consumed: dict[int, int] = field(default_factory=dict)
    alpha_changes: list[AlphaChange | MixtureChange | StepSkip] = field(default_factory=list)
    records: int = 0


def settled_floor(
    world_size: int, last_consumed: Mapping[int, int], ranks: Iterable[int], old_floor: int
) -> int:
    """The lowest seq a rank has not read past: each rank r reads r, r+W, ..., so every seq
    below min over ranks of (its last consumed + 1, or r if it read none) was read already."""
    bounds = [last_consumed[r] + 1 if r in last_consumed else r for r in ranks]
    return max(old_floor, min(bounds, default=old_floor))


@dataclass
class Plan:
    """Which records of the journal's first `end` bytes a compaction keeps."""

    end: int
    floor: int
    keep: list[int]  # offsets of the records to copy, ascending
    maybe: set[int]  # of those, the ones kept only if their states are not empty
    fold: set[int]  # seqs counted in folded from now on, no longer listed
    snapshot: Snapshot


def plan(
    state: SplitState,
    facts: Facts,
    *,
    end: int,
    floor: int,
    keep_seqs: int,
    slots: int,
) -> Plan:
    """Decide, from the split's state, what the compacted journal holds."""
    on_disk = set(state.files)
    keep: set[int] = set()
    maybe: set[int] = set()
    fold: set[int] = set()
    folded = Folded(**state.folded.__dict__)
    lowest_kept = floor - keep_seqs
    for seq, offset in state.offsets.items():
        if seq >= floor or seq in on_disk:
            keep.add(offset)
            continue
        fold.add(seq)
        folded.produced += 1
        if seq in state.consumed:
            folded.consumed += 1
        elif seq in state.quarantined:
            folded.quarantined += 1
        else:
            folded.missing += 1
        if seq >= lowest_kept:
            maybe.add(offset)
    for seq, offset in state.states_only.items():
        if seq >= lowest_kept:
            keep.add(offset)
    for seq, offset in state.advanced.items():
        if seq >= lowest_kept:
            keep.add(offset)
    # Each slot's stream resumes from its last forward record, and from its newest record.
    for _seq, offset in state.last_forward.values():
        keep.add(offset)
    newest: dict[int, tuple[int, int]] = {}
    for where in (state.offsets, state.advanced, state.states_only):
        for seq, offset in where.items():
            slot = seq % slots
            if slot not in newest or seq > newest[slot][0]:
                newest[slot] = (seq, offset)
    for _seq, offset in newest.values():
        keep.add(offset)
    maybe -= keep
    keep |= maybe
    c = state.counters
    snapshot = Snapshot(
        floor=floor,
        kept=0,  # set once the maybe-records are read
        world_size=facts.world_size,
        last_consumed=dict(facts.last_consumed),
        consumed=tuple(sorted(s for s in state.consumed if s not in fold)),
        quarantined=tuple(sorted(s for s in state.quarantined if s not in fold)),
        on_disk=tuple(sorted(on_disk)),
        alpha_changes=tuple(facts.alpha_changes),
        counts={
            "p": c.produced_files,
            "r": c.reproduced_files,
            "c": c.consumed_files,
            "q": c.quarantined_files,
            "b": c.produced_bytes,
        },
        folded=folded,
    )
    return Plan(end, floor, sorted(keep), maybe, fold, snapshot)


@dataclass
class Written:
    """The compacted journal, before the swap: where each kept record moved to."""

    path: Path
    moved: dict[int, int]


def _line(f: object, offset: int) -> bytes:
    f.seek(offset)  # type: ignore[attr-defined]
    return f.readline()  # type: ignore[attr-defined]


def _has_states(journal: Journal, offset: int) -> bool:
    record = journal.read_record(offset)
    return isinstance(record, (Produced, Advanced)) and bool(record.before or record.after)


def write(journal: Journal, plan: Plan) -> Written:
    """The snapshot and the kept records into a temp file beside the journal (a thread's job:
    it reads and fsyncs). The journal itself is not touched."""
    keep = [o for o in plan.keep if o not in plan.maybe or _has_states(journal, o)]
    snapshot = Snapshot(**{**plan.snapshot.__dict__, "kept": len(keep)})
    head = encode(snapshot)
    moved: dict[int, int] = {}
    staging = temp_path(journal.path)

    def fill(out: object) -> None:
        position = len(head)
        out.write(head)  # type: ignore[attr-defined]
        with open(journal.path, "rb") as old:
            for offset in keep:
                line = _line(old, offset)
                moved[offset] = position
                out.write(line)  # type: ignore[attr-defined]
                position += len(line)

    try:
        atomic_write(staging, fill)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return Written(staging, moved)


def apply(state: SplitState, plan: Plan, written: Written, base: int) -> None:
    """Fold the split's memory as the compacted journal replays: offsets into the new file,
    the folded seqs counted, not listed. Records appended during the compaction (at or after
    plan.end in the old file) start at `base` in the new one, and their seqs stay listed."""

    def remap(offset: int) -> int | None:
        if offset >= plan.end:
            return base + offset - plan.end
        return written.moved.get(offset)

    changed = {s for s, o in state.offsets.items() if o >= plan.end}
    offsets: dict[int, int] = {}
    states_only: dict[int, int] = {}
    for seq, offset in state.states_only.items():
        new = remap(offset)
        if new is not None:
            states_only[seq] = new
    for seq, offset in state.offsets.items():
        new = remap(offset)
        if seq in plan.fold and seq not in changed:
            if new is not None:
                states_only[seq] = new
        elif new is not None:
            offsets[seq] = new
    state.offsets = offsets
    state.states_only = states_only
    state.advanced = {s: n for s, o in state.advanced.items() if (n := remap(o)) is not None}
    state.last_forward = {
        slot: (seq, n)
        for slot, (seq, o) in state.last_forward.items()
        if (n := remap(o)) is not None
    }
    gone = plan.fold - changed
    state.consumed -= gone
    state.quarantined -= gone
    state.folded = plan.snapshot.folded
    state.floor = plan.floor


def compact_now(
    journal: Journal, state: SplitState, facts: Facts, *, floor: int, keep_seqs: int, slots: int
) -> None:
    """All three steps at once, with nothing appending meanwhile (a start, a test)."""
    p = plan(state, facts, end=journal.size, floor=floor, keep_seqs=keep_seqs, slots=slots)
    written = write(journal, p)
    try:
        base = journal.replace_with(written.path, p.end)
    except BaseException:
        written.path.unlink(missing_ok=True)
        raise
    apply(state, p, written, base)
    facts.records = 0
