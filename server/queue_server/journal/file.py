"""The journal file itself (open, append, replay, compact-swap): split from records.py to keep the record types apart."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

from queue_client import errors
from queue_client.format.batchfile import MAX_NAMED_SEQ
from queue_server.journal.records import (
    Advanced,
    JournalSummary,
    Produced,
    Record,
    decode,
    encode,
)

log = logging.getLogger("queue_server.journal")


class JournalLost(errors.BatchQueueError, OSError):
    """The journal file is gone, replaced or shorter than what this server wrote to it, or
    missing at start beside batch files that only it accounts for. Never papered over with a
    new journal: the message names the file."""


class StaleOffset(LookupError):
    """A journal offset from before a compaction: look the seq's record up again."""


class Journal:
    """One split's journal file. Opened for appending on first use (never created by replay),
    so a start can tell a missing journal from an empty one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = None
        self._identity: tuple[int, int] = (0, 0)
        # The end of what this server wrote: a file found shorter was cut under it.
        self._end = 0

    def exists(self) -> bool:
        return self.path.exists()

    def open(self) -> IO[bytes]:
        """The file, opened for appending (and created) on first use."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: each record is one write(), so a failed append leaves nothing pending.
            f = open(self.path, "ab", buffering=0)
            st = os.fstat(f.fileno())
            self._file, self._identity, self._end = f, (st.st_dev, st.st_ino), st.st_size
        return self._file

    @property
    def size(self) -> int:
        """Bytes this server knows are in the journal."""
        return self._end

    def replay(self) -> JournalSummary:
        summary = JournalSummary()
        offset = 0
        where = str(self.path)
        if not self.path.exists():
            return summary
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
                if record is None:
                    continue
                seq = getattr(record, "seq", 0)
                if not 0 <= seq <= MAX_NAMED_SEQ:
                    # Written before requests were bounded: no file name can hold that seq,
                    # and folding it in would break every count. Skipped, and said once per
                    # line. (Seqs past MAX_SEQ are the windows after the highest request.)
                    log.warning(
                        "%s: skipping the record at byte %d: seq %d is outside 0..%d",
                        where,
                        start,
                        seq,
                        MAX_NAMED_SEQ,
                    )
                    continue
                summary.apply(record, start)
        if self._file is not None:
            self._end = os.fstat(self._file.fileno()).st_size
        return summary

    def read_record(self, offset: int) -> Record | None:
        """The record whose line starts at offset (None if no whole record starts there)."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return decode(obj, str(self.path)) if isinstance(obj, dict) else None

    def read_states(
        self, offset: int, seq: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state before, state after) of the produced or advanced record at offset. With
        `seq`, raises StaleOffset unless that seq's record starts there (a compaction moved it)."""
        record = self.read_record(offset)
        if not isinstance(record, (Produced, Advanced)) or (seq is not None and record.seq != seq):
            if seq is not None:
                raise StaleOffset(f"{self.path}: seq {seq}'s record is no longer at {offset}")
            raise errors.ConfigError(f"{self.path}: no produced record at offset {offset}")
        return record.before, record.after

    def check(self) -> None:
        """Raise JournalLost if the file was deleted, replaced or cut under this server."""
        if self._file is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise JournalLost(
                f"the journal {self.path} was deleted while the server ran (it held "
                f"{self._end} bytes); nothing more is written until it is dealt with"
            ) from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise JournalLost(
                f"the journal {self.path} was replaced by another file while the server ran; "
                "nothing more is written until it is dealt with"
            )
        if st.st_size < self._end:
            raise JournalLost(
                f"the journal {self.path} was cut to {st.st_size} bytes while the server ran "
                f"(it had written {self._end}); nothing more is written until it is dealt with"
            )

    def append(self, record: Record) -> int:
        """Append one record; returns the offset where it starts. Raises JournalLost (the file
        went away under the server), or OSError (a full disk, say) with nothing half-written
        left behind as a valid line."""
        f = self.open()
        self.check()
        offset = os.fstat(f.fileno()).st_size
        line = encode(record)
        try:
            written = 0
            while written < len(line):  # a short write is continued: the next one says why
                n = f.write(line[written:])
                if not n:
                    raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
                written += n
        except OSError:
            # A torn line would swallow the next record when replayed: cut it off.
            try:
                f.truncate(offset)
            except OSError:
                pass
            raise
        self._end = offset + len(line)
        return offset

    def replace_with(self, compacted: Path, copied_up_to: int) -> int:
        """Make `compacted` (written from this journal's first `copied_up_to` bytes) the
        journal: the lines appended since are copied after it, then it is renamed over the
        journal in one step. Returns where those copied lines start in the new file."""
        f = self.open()
        self.check()
        with open(self.path, "rb") as old:
            old.seek(copied_up_to)
            tail = old.read()
        with open(compacted, "ab", buffering=0) as new:
            base = os.fstat(new.fileno()).st_size
            if tail:
                new.write(tail)
        os.replace(compacted, self.path)
        f.close()
        self._file = None
        self.open()
        return base

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
