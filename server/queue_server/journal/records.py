"""The append-only journal of one split: which seqs were produced, consumed or quarantined.

One JSON object per line in the split's journal file (queue_client.format.layout names it), written
by the event loop with a flush per line: a process crash loses nothing; a power cut may lose
the tail, after which unjournaled files are removed and produced again, identically. A
"produced" record holds the provider's stream state before and after the file, so any seq can
be produced again and a restarted producer carries on where the last one stopped.

An "advanced" record is a file a streaming provider made only to move its stream past a seq
that no rank of this server reads (node-local serving, docs/multi-node.md): no file was
written, but its states are kept, so the stream resumes after it and the seq can still be
made, byte for byte, if a rank asks for it after all.

A "snapshot" record (journal/compaction.py writes it, first in a compacted journal) holds the folded
state of every record it replaced, followed by the `kept` records whose states a restart still
needs, copied as they were: so a restart reads a journal whose length does not grow with the
files served. Seqs below its `floor` were read by their rank already and are kept only as
counts.

Records are typed (the dataclasses below) and versioned: each line carries "v". Lines from
before versions existed (no "v") are version 1, with the same keys, and still load. Version 3
added "advanced" records, version 4 "snapshot" records, version 5 "mix" records (SetMixture
calls, kept among the setting changes a snapshot carries).

The file is checked before every append: a journal deleted, replaced or cut shorter under a
running server raises JournalLost naming it, rather than the server writing on into a file
that a restart would not find.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from queue_client import errors

log = logging.getLogger("queue_server.journal")

JOURNAL_VERSION = 5


@dataclass(frozen=True)
class Produced:
    seq: int
    name: str
    size_bytes: int
    crc32: int
    slot: int
    forward: bool  # made by the slot's forward stream (False: made again from a state)
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Advanced:
    """Seq's batches were made by the slot's forward stream and dropped: no file."""

    seq: int
    slot: int
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Consumed:
    seq: int
    world_size: int


@dataclass(frozen=True)
class Quarantined:
    seq: int
    reason: str


@dataclass(frozen=True)
class AlphaChange:
    """A SetCurriculum call: alpha (None: back to the schedule) from seq `at` on."""

    at: int
    alpha: float | None
    rank: int


@dataclass(frozen=True)
class MixtureChange:
    """A SetMixture call: weights by source name (None: back to the config's) from seq `at`."""

    at: int
    weights: dict[str, float] | None
    rank: int


@dataclass(frozen=True)
class StepSkip:
    """A SkipSteps call: global steps [at, to) leave every rank's stream."""

    at: int
    to: int
    rank: int


@dataclass
class Folded:
    """Seqs below a compaction floor, by their last state: counted, no longer listed."""

    produced: int = 0
    consumed: int = 0
    quarantined: int = 0
    missing: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The state folded from the records a compaction replaced. The `kept` records after it
    are restored (their seqs' states and files), not counted again."""

    floor: int
    kept: int
    world_size: int
    last_consumed: dict[int, int]
    consumed: tuple[int, ...]
    quarantined: tuple[int, ...]
    on_disk: tuple[int, ...]
    alpha_changes: tuple[AlphaChange | MixtureChange | StepSkip, ...]
    counts: dict[str, int]
    folded: Folded


Record = (
    Produced | Advanced | Consumed | Quarantined | AlphaChange | MixtureChange | StepSkip | Snapshot
)


def _snapshot_obj(record: Snapshot) -> dict[str, Any]:
    f = record.folded
    return {
        "e": "s",
        "floor": record.floor,
        "kept": record.kept,
        "ws": record.world_size,
        "last": {str(k): v for k, v in sorted(record.last_consumed.items())},
        "consumed": list(record.consumed),
        "quarantined": list(record.quarantined),
        "disk": list(record.on_disk),
        "alpha": [_change_entry(a) for a in record.alpha_changes],
        "counts": record.counts,
        "folded": [f.produced, f.consumed, f.quarantined, f.missing],
    }


def _change_entry(change: AlphaChange | MixtureChange | StepSkip) -> list[Any]:
    """A setting change in a snapshot: [at, alpha, rank], [at, weights, rank, "mix"], or
    [from, to, rank, "skip"]."""
    if isinstance(change, MixtureChange):
        return [change.at, change.weights, change.rank, "mix"]
    if isinstance(change, StepSkip):
        return [change.at, change.to, change.rank, "skip"]
    return [change.at, change.alpha, change.rank]


def encode(record: Record) -> bytes:
    """One journal line."""
    if isinstance(record, Produced):
        obj: dict[str, Any] = {
            "e": "p",
            "seq": record.seq,
            "name": record.name,
            "bytes": record.size_bytes,
            "crc": record.crc32,
            "w": record.slot,
            "fwd": record.forward,
            "before": record.before,
            "after": record.after,
        }
    elif isinstance(record, Advanced):
        obj = {
            "e": "a",
            "seq": record.seq,
            "w": record.slot,
            "before": record.before,
            "after": record.after,
        }
    elif isinstance(record, Consumed):
        obj = {"e": "c", "seq": record.seq, "ws": record.world_size}
    elif isinstance(record, Quarantined):
        obj = {"e": "q", "seq": record.seq, "why": record.reason}
    elif isinstance(record, Snapshot):
        obj = _snapshot_obj(record)
    elif isinstance(record, MixtureChange):
        obj = {"e": "mix", "at": record.at, "weights": record.weights, "rank": record.rank}
    elif isinstance(record, StepSkip):
        obj = {"e": "skip", "at": record.at, "to": record.to, "rank": record.rank}
    else:
        obj = {"e": "alpha", "at": record.at, "alpha": record.alpha, "rank": record.rank}
    obj["v"] = JOURNAL_VERSION
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _alpha(
    at: Any, alpha: Any, rank: Any, kind: str = "alpha"
) -> AlphaChange | MixtureChange | StepSkip:
    if kind == "mix":
        return _mix(at, alpha, rank)
    if kind == "skip":
        return StepSkip(int(at), int(alpha), int(rank))
    return AlphaChange(int(at), None if alpha is None else float(alpha), int(rank))


def _mix(at: Any, weights: Any, rank: Any) -> MixtureChange:
    parsed = None if weights is None else {str(k): float(v) for k, v in dict(weights).items()}
    return MixtureChange(int(at), parsed, int(rank))


def _decode_snapshot(obj: dict[str, Any]) -> Snapshot:
    folded = [int(x) for x in obj.get("folded") or (0, 0, 0, 0)]
    return Snapshot(
        floor=int(obj["floor"]),
        kept=int(obj["kept"]),
        world_size=int(obj.get("ws", 1)),
        last_consumed={int(k): int(v) for k, v in (obj.get("last") or {}).items()},
        consumed=tuple(int(s) for s in obj.get("consumed") or ()),
        quarantined=tuple(int(s) for s in obj.get("quarantined") or ()),
        on_disk=tuple(int(s) for s in obj.get("disk") or ()),
        alpha_changes=tuple(_alpha(*a) for a in obj.get("alpha") or ()),
        counts={str(k): int(v) for k, v in (obj.get("counts") or {}).items()},
        folded=Folded(*folded[:4]),
    )


def decode(obj: dict[str, Any], where: str) -> Record | None:
    """The record of one parsed line; None for a kind this version does not know."""
    version = obj.get("v", 1)
    if not isinstance(version, int) or version > JOURNAL_VERSION:
        raise errors.ConfigError(
            f"{where} was written by a newer batchqueue (journal version {version!r}, this one "
            f"reads up to {JOURNAL_VERSION}); upgrade the server"
        )
    kind = obj.get("e")
    if kind == "p":
        return Produced(
            int(obj["seq"]),
            str(obj["name"]),
            int(obj["bytes"]),
            int(obj["crc"]),
            int(obj["w"]),
            bool(obj.get("fwd", True)),
            obj.get("before") or {},
            obj.get("after") or {},
        )
    if kind == "a":
        return Advanced(
            int(obj["seq"]), int(obj["w"]), obj.get("before") or {}, obj.get("after") or {}
        )
    if kind == "c":
        return Consumed(int(obj["seq"]), int(obj.get("ws", 1)))
    if kind == "q":
        return Quarantined(int(obj["seq"]), str(obj.get("why", "")))
    if kind == "alpha":
        return _alpha(obj["at"], obj.get("alpha"), obj.get("rank", 0))
    if kind == "s":
        return _decode_snapshot(obj)
    if kind == "mix":
        return _mix(obj["at"], obj.get("weights"), obj.get("rank", 0))
    if kind == "skip":
        return StepSkip(int(obj["at"]), int(obj["to"]), int(obj.get("rank", 0)))
    return None


@dataclass
class ProducedEntry:
    """A produced record as replay keeps it: where its line starts, not its (large) states."""

    seq: int
    name: str
    size_bytes: int
    crc32: int
    slot: int
    offset: int


@dataclass
class JournalSummary:
    """What replaying a journal tells a restarted server."""

    # seq -> its latest produced record, while its file may still be on disk.
    produced: dict[int, ProducedEntry] = field(default_factory=dict)
    # seq -> offset of its latest produced record, kept after consumption for reproduction.
    offsets: dict[int, int] = field(default_factory=dict)
    consumed: set[int] = field(default_factory=set)
    quarantined: dict[int, str] = field(default_factory=dict)
    produced_count: int = 0
    reproduced_count: int = 0
    consumed_count: int = 0
    quarantined_count: int = 0
    produced_bytes: int = 0
    # seq -> offset of its latest advanced record (made and dropped: no file).
    advanced: dict[int, int] = field(default_factory=dict)
    # slot -> (last forward seq, offset of its record), to resume each slot's stream.
    last_forward: dict[int, tuple[int, int]] = field(default_factory=dict)
    world_size: int = 1
    # rank -> last consumed seq, under world_size.
    last_consumed: dict[int, int] = field(default_factory=dict)
    alpha_changes: list[AlphaChange | MixtureChange | StepSkip] = field(default_factory=list)
    # From the last snapshot: seqs below floor are folded into counts; states_only maps a seq
    # below it to the record that can make it again (a rewind), without it being accounted.
    floor: int = 0
    folded: Folded = field(default_factory=Folded)
    states_only: dict[int, int] = field(default_factory=dict)
    # Records after the last snapshot (all of them without one): what a compaction would fold.
    records: int = 0
    _restoring: int = 0
    _disk: frozenset[int] = frozenset()

    def apply(self, record: Record, offset: int) -> None:
        if isinstance(record, Snapshot):
            self._reset(record)
            return
        if self._restoring:
            self._restoring -= 1
            self._restore(record, offset)
            return
        self.records += 1
        if isinstance(record, Produced):
            seq = record.seq
            made = seq in self.produced or seq in self.consumed or seq in self.quarantined
            if made or seq < self.floor:  # below a snapshot's floor: made before it
                self.reproduced_count += 1
            else:
                self.produced_count += 1
            self.produced_bytes += record.size_bytes
            self.offsets[seq] = offset
            self.produced[seq] = ProducedEntry(
                seq, record.name, record.size_bytes, record.crc32, record.slot, offset
            )
            self.consumed.discard(seq)
            self.quarantined.pop(seq, None)
            if record.forward:
                self._forward(record.slot, seq, offset)
        elif isinstance(record, Advanced):
            self.advanced[record.seq] = offset
            self._forward(record.slot, record.seq, offset)
        elif isinstance(record, Consumed):
            self.consumed_count += 1
            self.consumed.add(record.seq)
            self.produced.pop(record.seq, None)
            w = record.world_size
            self.world_size = w
            rank = record.seq % w
            self.last_consumed[rank] = max(record.seq, self.last_consumed.get(rank, -1))
        elif isinstance(record, Quarantined):
            self.quarantined_count += 1
            self.quarantined[record.seq] = record.reason
            self.produced.pop(record.seq, None)
        else:
            self.alpha_changes.append(record)

    def _reset(self, snap: Snapshot) -> None:
        """Start over from a snapshot: the records before it are folded into it."""
        fresh = JournalSummary()
        self.__dict__.update(fresh.__dict__)
        c = snap.counts
        self.produced_count, self.reproduced_count = c.get("p", 0), c.get("r", 0)
        self.consumed_count, self.quarantined_count = c.get("c", 0), c.get("q", 0)
        self.produced_bytes = c.get("b", 0)
        self.world_size, self.last_consumed = snap.world_size, dict(snap.last_consumed)
        self.consumed = set(snap.consumed)
        self.quarantined = {s: "" for s in snap.quarantined}
        self.alpha_changes = list(snap.alpha_changes)
        self.floor, self.folded = snap.floor, Folded(**snap.folded.__dict__)
        self._restoring, self._disk = snap.kept, frozenset(snap.on_disk)

    def _restore(self, record: Record, offset: int) -> None:
        """A record a snapshot kept: its seq's states (and file, if on disk), not counted."""
        if isinstance(record, Produced):
            seq = record.seq
            if seq < self.floor and seq not in self._disk:
                self.states_only[seq] = offset
            else:
                self.offsets[seq] = offset
            if seq in self._disk:
                self.produced[seq] = ProducedEntry(
                    seq, record.name, record.size_bytes, record.crc32, record.slot, offset
                )
            if record.forward:
                self._forward(record.slot, seq, offset)
        elif isinstance(record, Advanced):
            self.advanced[record.seq] = offset
            self._forward(record.slot, record.seq, offset)

    def _forward(self, slot: int, seq: int, offset: int) -> None:
        prev = self.last_forward.get(slot)
        if prev is None or seq > prev[0]:
            self.last_forward[slot] = (seq, offset)
