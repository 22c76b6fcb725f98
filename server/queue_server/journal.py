"""The append-only journal of one split: which seqs were produced, consumed or quarantined.

One JSON object per line in the split's journal file (queue_client.layout names it), written
by the event loop with a flush per line: a process crash loses nothing; a power cut may lose
the tail, after which unjournaled files are removed and produced again, identically. A
"produced" record holds the provider's stream state before and after the file, so any seq can
be produced again and a restarted producer carries on where the last one stopped.

An "advanced" record is a file a streaming provider made only to move its stream past a seq
that no rank of this server reads (node-local serving, docs/multi-node.md): no file was
written, but its states are kept, so the stream resumes after it and the seq can still be
made, byte for byte, if a rank asks for it after all.

Records are typed (the dataclasses below) and versioned: each line carries "v". Lines from
before versions existed (no "v") are version 1, with the same keys, and still load. Version 3
added "advanced" records.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from queue_client import errors

JOURNAL_VERSION = 3


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


Record = Produced | Advanced | Consumed | Quarantined | AlphaChange


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
    else:
        obj = {"e": "alpha", "at": record.at, "alpha": record.alpha, "rank": record.rank}
    obj["v"] = JOURNAL_VERSION
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


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
        alpha = obj.get("alpha")
        return AlphaChange(
            int(obj["at"]), None if alpha is None else float(alpha), int(obj.get("rank", 0))
        )
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
    alpha_changes: list[AlphaChange] = field(default_factory=list)

    def apply(self, record: Record, offset: int) -> None:
        if isinstance(record, Produced):
            seq = record.seq
            if seq in self.produced or seq in self.consumed or seq in self.quarantined:
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

    def _forward(self, slot: int, seq: int, offset: int) -> None:
        prev = self.last_forward.get(slot)
        if prev is None or seq > prev[0]:
            self.last_forward[slot] = (seq, offset)


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: each record is one write(), so a failed append leaves nothing pending.
        self._file: IO[bytes] = open(self.path, "ab", buffering=0)

    def replay(self) -> JournalSummary:
        summary = JournalSummary()
        offset = 0
        where = str(self.path)
        with open(self.path, "rb") as lines:
            for line in lines:
                start, offset = offset, offset + len(line)
                if not line.endswith(b"\n"):
                    # A torn last line from a crash: cut it off, or the next record appended
                    # would be glued to it and lost on the next replay.
                    os.truncate(self.path, start)
                    break
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                record = decode(obj, where)
                if record is not None:
                    summary.apply(record, start)
        return summary

    def read_states(self, offset: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state before, state after) of the produced or advanced record at offset."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            record = decode(json.loads(f.readline()), str(self.path))
        if not isinstance(record, (Produced, Advanced)):
            raise errors.ConfigError(f"{self.path}: no produced record at offset {offset}")
        return record.before, record.after

    def append(self, record: Record) -> int:
        """Append one record; returns the offset where it starts. Raises OSError (a full
        disk, say) with nothing half-written left behind as a valid line."""
        offset = os.fstat(self._file.fileno()).st_size
        line = encode(record)
        try:
            written = self._file.write(line)
            if written != len(line):
                raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        except OSError:
            # A torn line would swallow the next record when replayed: cut it off.
            try:
                self._file.truncate(offset)
            except OSError:
                pass
            raise
        return offset

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
