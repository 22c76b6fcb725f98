"""The append-only journal of one split: which seqs were produced, consumed or quarantined.

One JSON object per line in <dataset>/journal/<split>.jsonl. It is written by the event loop
with a flush per line (a process crash loses nothing; a power cut may lose the tail, after
which unjournaled files are removed and produced again, identically). A "produced" record holds
the provider's stream state before and after the file, so any seq can be produced again and a
restarted worker carries on where the last one stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@dataclass
class ProducedRecord:
    seq: int
    name: str
    size_bytes: int
    crc32: int
    worker: int
    offset: int  # where the line starts, to read its state back only when needed


@dataclass
class JournalSummary:
    """What replaying a journal tells a restarted server."""

    produced: dict[int, ProducedRecord] = field(default_factory=dict)
    # seq -> offset of its latest produced record, kept after consumption for reproduction.
    offsets: dict[int, int] = field(default_factory=dict)
    consumed: set[int] = field(default_factory=set)
    quarantined: dict[int, str] = field(default_factory=dict)
    produced_count: int = 0
    reproduced_count: int = 0
    consumed_count: int = 0
    quarantined_count: int = 0
    produced_bytes: int = 0
    # worker index -> (last forward seq, offset of its record), to resume each worker's stream.
    last_forward: dict[int, tuple[int, int]] = field(default_factory=dict)
    world_size: int = 1
    # rank -> last consumed seq, under world_size.
    last_consumed: dict[int, int] = field(default_factory=dict)
    # SetCurriculum calls in order: (first seq, alpha or None).
    alpha_overrides: list[tuple[int, float | None]] = field(default_factory=list)


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "a+b")

    def replay(self) -> JournalSummary:
        summary = JournalSummary()
        self._file.seek(0)
        offset = 0
        while True:
            line = self._file.readline()
            if not line:
                break
            start, offset = offset, offset + len(line)
            if not line.endswith(b"\n"):
                break  # a torn last line from a crash: ignore it
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            kind, seq = rec.get("e"), rec.get("seq")
            if kind == "p":
                if seq in summary.produced or seq in summary.consumed or seq in summary.quarantined:
                    summary.reproduced_count += 1
                else:
                    summary.produced_count += 1
                summary.produced_bytes += rec["bytes"]
                summary.offsets[seq] = start
                summary.produced[seq] = ProducedRecord(
                    seq, rec["name"], rec["bytes"], rec["crc"], rec["w"], start
                )
                summary.consumed.discard(seq)
                summary.quarantined.pop(seq, None)
                if rec.get("fwd", True):
                    prev = summary.last_forward.get(rec["w"])
                    if prev is None or seq > prev[0]:
                        summary.last_forward[rec["w"]] = (seq, start)
            elif kind == "c":
                summary.consumed_count += 1
                summary.consumed.add(seq)
                summary.produced.pop(seq, None)
                w = rec.get("ws", 1)
                summary.world_size = w
                summary.last_consumed[seq % w] = max(seq, summary.last_consumed.get(seq % w, -1))
            elif kind == "alpha":
                summary.alpha_overrides.append((int(rec["at"]), rec.get("alpha")))
            elif kind == "q":
                summary.quarantined_count += 1
                summary.quarantined[seq] = rec.get("why", "")
                summary.produced.pop(seq, None)
        self._file.seek(0, os.SEEK_END)
        return summary

    def read_states(self, offset: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state before, state after) of the produced record at offset."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            rec = json.loads(f.readline())
        return rec.get("before") or {}, rec.get("after") or {}

    def append(self, record: dict[str, Any]) -> int:
        """Append one record; returns the offset where it starts."""
        self._file.seek(0, os.SEEK_END)
        offset = self._file.tell()
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        return offset

    def close(self) -> None:
        self._file.close()
