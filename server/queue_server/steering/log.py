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

Snapshots keep a late reader's start short: the log grows by a claim per server per round of
files for as long as the job runs, and a server that joins (or replaces a lost one) would read
all of it. Every `snapshot_every` records, whichever server reads past the boundary first
puts `<prefix>snapshot-<snapshot_every>/<m>` (put-if-absent: every server computes the same
one from the same prefix): the highest horizon claimed before record m * snapshot_every, and
the changes since snapshot m - 1 with their seqs (so the snapshots hold each change once,
however many there are). A reader starting from nothing finds the latest snapshot (doubling,
then halving: a few gets), reads it and those before it for their changes, and reads on from
its record; it gets what reading every record gives: the same changes at the same seqs, the
same horizon. Records are never deleted: a reader part-way through must find them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from queue_server.steering.store import ControlStore

CLAIM, MIXTURE, ALPHA, SKIP = "claim", "mix", "alpha", "skip"
CHANGES = (MIXTURE, ALPHA, SKIP)
SNAPSHOT_EVERY = 4096  # records between snapshots (server.control_snapshot_records)


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

    def __init__(
        self, store: ControlStore, prefix: str, snapshot_every: int = SNAPSHOT_EVERY
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.snapshot_every = snapshot_every
        self.length = 0  # records read so far
        self.horizon = 0  # the highest horizon claimed in them
        self.last: bytes | None = None  # the last record read, to know the store again
        # The changes read since the last snapshot boundary ({"index", "at", "record"}): what
        # the next snapshot holds; and how many were read (or taken from snapshots) in all.
        self.changes: list[dict[str, Any]] = []
        self.changes_known = 0
        self.started_at = 0  # the record the first read started at (a snapshot's, or 0)
        self.appended = 0  # records this server appended (for the bench's counts)
        self.bytes_written = 0
        self.gets = 0  # store reads, for the bench and the tests

    def key(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def snapshot_key(self, number: int) -> str:
        """Snapshot `number` (of records [0, number * snapshot_every)): servers set to another
        interval keep snapshots of their own."""
        return f"{self.prefix}snapshot-{self.snapshot_every}/{number}"

    def read_new(self) -> list[Entry]:
        """Every record past those read already, in order (from the latest snapshot, its
        changes first, when nothing was read yet)."""
        out: list[Entry] = self._from_snapshot() if not self.length else []
        while True:
            raw = self._get(self.key(self.length))
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
        self.length = self.horizon = self.started_at = 0
        self.last = None
        self.changes = []
        self.changes_known = 0

    def _get(self, key: str) -> bytes | None:
        self.gets += 1
        return self.store.get(key)

    def _fold(self, record: dict[str, Any]) -> Entry:
        kind = str(record.get("kind"))
        if kind == CLAIM:
            entry = Entry(self.length, kind, int(record["horizon"]), record)
            self.horizon = max(self.horizon, entry.at)
        else:
            entry = Entry(self.length, kind, change_at(record, self.horizon), record)
            self.changes.append({"index": entry.index, "at": entry.at, "record": record})
            self.changes_known += 1
        self.length += 1
        if self.length % self.snapshot_every == 0:
            self._put_snapshot()
        return entry

    # ---- snapshots ---------------------------------------------------------------------------
    def _put_snapshot(self) -> None:
        """The snapshot of the records read (a whole number of snapshot_every): put unless
        another server put it first (theirs is the same)."""
        body = {"records": self.length, "horizon": self.horizon, "changes": self.changes}
        data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        self.store.put_if_absent(self.snapshot_key(self.length // self.snapshot_every), data)
        self.changes = []

    def _latest_snapshot(self) -> tuple[int, bytes] | None:
        """The highest-numbered snapshot (they are put in order: doubling, then halving the
        gap, finds it in about 2 log2(n) gets), or None."""
        found: tuple[int, bytes] | None = None
        low, high = 0, 1
        while (raw := self._get(self.snapshot_key(high))) is not None:
            found, low, high = (high, raw), high, high * 2
        while high - low > 1:  # snapshot `low` exists, `high` does not
            middle = (low + high) // 2
            raw = self._get(self.snapshot_key(middle))
            if raw is None:
                high = middle
            else:
                found, low = (middle, raw), middle
        return found

    def _from_snapshot(self) -> list[Entry]:
        """Start from the latest snapshot: every change up to it (its own and those of the
        snapshots before it) as entries, in order, and the records after it left to read.
        Nothing (read from 0) when there is none, or when one does not fit its records."""
        latest = self._latest_snapshot()
        if latest is None:
            return []
        number, raw = latest
        pieces: list[list[dict[str, Any]]] = []  # each snapshot's changes, latest first
        horizon = 0
        for earlier in range(number, 0, -1):
            body = raw if earlier == number else self._get(self.snapshot_key(earlier))
            doc = json.loads(body) if body is not None else {}
            if int(doc.get("records", -1)) != earlier * self.snapshot_every:
                return []
            if earlier == number:
                horizon = int(doc["horizon"])
            pieces.append(doc["changes"])
        records = number * self.snapshot_every
        last = self._get(self.key(records - 1))
        if last is None:
            return []
        self.length = self.started_at = records
        self.horizon = horizon
        self.last = last
        self.changes = []
        known = [change for piece in reversed(pieces) for change in piece]
        self.changes_known = len(known)
        return [
            Entry(int(c["index"]), str(c["record"]["kind"]), int(c["at"]), c["record"])
            for c in known
        ]
