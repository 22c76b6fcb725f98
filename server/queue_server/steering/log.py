"""One split's control log: an append-only list of records in the job's store, the same list
for every server of the job, read in order by each.

Two kinds of record. A *claim* (`horizon` H) is a server saying "I may make seqs below H";
it appends one before it makes a seq past its last claim, having read every record before
it. A *change* (SetMixture, SetCurriculum) carries the caller's position and the window
rule's numbers, and takes effect at

    at = max(W * (position // W + files_per_window + 1), every claim's horizon before it)

(without a position: the horizons alone), so every server computes the same `at` from the
same prefix of the log, and no server made a seq at or past `at` without the change: it made
them under a claim, and each claim before the change is at most `at`, while a server reads the
change before any claim after it. A change republished from a server's own journal (the store
was started afresh) carries its `at` as it was.

Appending is put-if-absent on key `<prefix><index>`: the store's one master orders racing
appenders, the loser reads the winner's record and tries the next index.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from queue_server.steering.store import ControlStore

CLAIM, MIXTURE, ALPHA, SKIP = "claim", "mix", "alpha", "skip"
CHANGES = (MIXTURE, ALPHA, SKIP)


@dataclass(frozen=True)
class Entry:
    """A record read from the log, with the seq it takes effect at (a change) or the horizon
    it claims (a claim)."""

    index: int
    kind: str
    at: int  # a change's first seq; a claim's horizon
    record: dict[str, Any]

    @property
    def payload(self) -> Any:
        """A change's value: weights by name (or None) for SetMixture, alpha for SetCurriculum,
        [from_step, to_step] for SkipSteps."""
        return self.record.get("value")

    @property
    def rank(self) -> int:
        return int(self.record.get("rank", 0))


def change_at(record: dict[str, Any], horizon: int) -> int:
    """The first seq of a change given the highest horizon claimed before it."""
    if record.get("at") is not None:
        return int(record["at"])
    position = record.get("position")
    if position is None:
        return horizon
    w, files = int(record["world_size"]), int(record["files_per_window"])
    return max(horizon, w * (int(position) // w + files + 1))


class ControlLog:
    """The reader and appender of one split's log (blocking; one thread at a time)."""

    def __init__(self, store: ControlStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.length = 0  # records read so far
        self.horizon = 0  # the highest horizon claimed in them
        self.last: bytes | None = None  # the last record read, to know the store again
        self.appended = 0  # records this server appended (for the bench's counts)
        self.bytes_written = 0

    def key(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def read_new(self) -> list[Entry]:
        """Every record past those read already, in order."""
        out: list[Entry] = []
        while True:
            raw = self.store.get(self.key(self.length))
            if raw is None:
                return out
            self.last = raw
            out.append(self._fold(json.loads(raw)))

    def append(self, record: dict[str, Any]) -> tuple[list[Entry], Entry]:
        """Append a record after every record before it was read; returns the records read
        on the way (the caller applies them first, in order) and the record's own entry."""
        body = json.dumps({**record, "nonce": uuid.uuid4().hex}, separators=(",", ":")).encode()
        read: list[Entry] = []
        while True:
            read += self.read_new()
            held = self.store.put_if_absent(self.key(self.length), body)
            if held == body:
                self.last = body
                self.appended += 1
                self.bytes_written += len(body)
                return read, self._fold(json.loads(body))
            # Another server appended at this index first: read it, try the next one.

    def same_store(self) -> bool:
        """Whether the store still holds the last record read (False: it was started afresh,
        and other servers may have written a new log into it already)."""
        return not self.length or self.store.get(self.key(self.length - 1)) == self.last

    def restart(self) -> None:
        """Read the log from its first record again."""
        self.length = self.horizon = 0
        self.last = None

    def _fold(self, record: dict[str, Any]) -> Entry:
        kind = str(record.get("kind"))
        if kind == CLAIM:
            entry = Entry(self.length, kind, int(record["horizon"]), record)
            self.horizon = max(self.horizon, entry.at)
        else:
            entry = Entry(self.length, kind, change_at(record, self.horizon), record)
        self.length += 1
        return entry
