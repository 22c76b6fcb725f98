"""Every append to one split's journal goes through here: what happens when it cannot be
written, when it went away, and when it grew long enough to compact.

- A write error (ENOSPC, EIO, EPERM, ...) puts the split in the disk-error state: it makes
  nothing and hands out nothing (a file whose consumption cannot be journaled must not be
  served), the error with the path and errno text is in its stats and in the dataset's health,
  and a probe with backoff (0.5 s doubling to 30 s) writes a page beside the journal until that
  succeeds; then the split serves again by itself. Nothing is lost: a record that was not
  written changed nothing (a CONSUMED release is kept by the split and journaled then:
  split/removal.py).
- A journal deleted, replaced or cut shorter under the server (journal.JournalLost) stops the
  split for good, named in the log, stats and health, instead of writing on into a file no
  restart would find.
- Every `compact_records` records, a compaction (journal/compaction.py) runs beside the appends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable

from queue_client.format.layout import temp_path
from queue_server.background import BackgroundTasks
from queue_server.journal import compaction
from queue_server.journal.file import Journal, JournalLost
from queue_server.journal.records import AlphaChange, Consumed, MixtureChange, Record, StepSkip
from queue_server.split.state import SplitState

log = logging.getLogger("queue_server.journal")

PROBE_BACKOFF_S = (0.5, 30.0)
_PROBE_BYTES = 4096


class JournalUnwritable(OSError):
    """The record was not journaled: the split is in the disk-error or journal-lost state."""


class JournalKeeper:
    def __init__(
        self,
        journal: Journal,
        where: str,
        state: SplitState,
        on_trouble: Callable[[str | None], None],
        *,
        compact_records: int = 0,
        keep_files: int = 0,
        slots: Callable[[], int] = lambda: 1,
        ranks: Callable[[int], Iterable[int]] = range,
    ) -> None:
        self.journal = journal
        self.where = where
        self.state = state
        self.facts = compaction.Facts()
        self._on_trouble = on_trouble
        self.compact_records = compact_records
        self.keep_files = keep_files
        self._slots = slots
        self._ranks = ranks
        self.lost = False
        self._probe_s = PROBE_BACKOFF_S[0]
        self._probing = False
        self._compacting = False
        self._next_compaction = compact_records
        self._tasks = BackgroundTasks()
        self.compactions = 0

    @property
    def healthy(self) -> bool:
        return not self.state.journal_error

    # ---- appends -------------------------------------------------------------------------
    def append(self, record: Record) -> int:
        """Journal one record; raises JournalUnwritable (an OSError) when it was not written."""
        if self.lost:
            raise JournalUnwritable(self.state.journal_error)
        try:
            offset = self.journal.append(record)
        except JournalLost as exc:
            self._lose(str(exc))
            raise JournalUnwritable(self.state.journal_error) from None
        except OSError as exc:
            self._disk_error(exc)
            raise JournalUnwritable(self.state.journal_error) from None
        if not self.healthy:
            self._recovered("a journal append succeeded")
        self._probe_s = PROBE_BACKOFF_S[0]
        self._note(record)
        return offset

    def _note(self, record: Record) -> None:
        facts = self.facts
        facts.records += 1
        if isinstance(record, Consumed):
            facts.world_size = record.world_size
            rank = record.seq % record.world_size
            facts.last_consumed[rank] = max(record.seq, facts.last_consumed.get(rank, -1))
        elif isinstance(record, (AlphaChange, MixtureChange, StepSkip)):
            facts.alpha_changes.append(record)
        if self.compact_records and facts.records >= self._next_compaction and not self._compacting:
            self._compacting = True
            self._tasks.spawn(self._compact())

    # ---- trouble -------------------------------------------------------------------------
    def _disk_error(self, exc: OSError) -> None:
        self.state.counters.disk_errors += 1
        reason = f"cannot append to the journal {self.journal.path}: {_errno_text(exc)}"
        first = self.healthy
        self.state.journal_error = self.state.last_disk_error = reason
        if first:
            log.error(
                "%s: %s; it serves nothing until the journal can be written again "
                "(probing every %.1fs at first)",
                self.where,
                reason,
                self._probe_s,
            )
            self._on_trouble(reason)
        self._start_probe()

    def _lose(self, message: str) -> None:
        if self.lost:
            return
        self.lost = True
        self.state.journal_error = message
        log.error("%s: %s", self.where, message)
        self._on_trouble(message)

    def _recovered(self, how: str) -> None:
        log.warning(
            "%s: the journal %s can be written again (%s); serving again",
            self.where,
            self.journal.path,
            how,
        )
        self.state.journal_error = ""
        self.state.last_disk_error = ""
        self._on_trouble(None)

    def _start_probe(self) -> None:
        if not self._probing and not self.lost:
            self._probing = True
            self._tasks.spawn(self._probe())

    async def _probe(self) -> None:
        """Until a page can be written beside the journal: wait, doubling up to 30 s."""
        try:
            while not self.healthy and not self.lost:
                delay = self._probe_s
                self._probe_s = min(delay * 2, PROBE_BACKOFF_S[1])
                await asyncio.sleep(delay)  # backoff between probes, not synchronisation
                if self.healthy or self.lost:
                    return
                try:
                    await asyncio.to_thread(self._probe_write)
                except JournalLost as exc:
                    self._lose(str(exc))
                    return
                except OSError as exc:
                    log.warning(
                        "%s: the journal still cannot be written (%s); next probe in %.1fs",
                        self.where,
                        _errno_text(exc),
                        self._probe_s,
                    )
                    continue
                self._recovered("a probe write succeeded")
        finally:
            self._probing = False

    def _probe_write(self) -> None:
        self.journal.check()
        probe = temp_path(self.journal.path)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if os.write(fd, b"\0" * _PROBE_BYTES) != _PROBE_BYTES:
                    raise OSError(f"short write to {probe}")
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)

    # ---- compaction ----------------------------------------------------------------------
    def floor(self) -> int:
        f = self.facts
        return compaction.settled_floor(
            f.world_size, f.last_consumed, self._ranks(f.world_size), self.state.floor
        )

    def compact_now(self) -> None:
        """Compact with nothing appending meanwhile (at start, in a thread)."""
        compaction.compact_now(
            self.journal,
            self.state,
            self.facts,
            floor=self.floor(),
            keep_seqs=self.keep_files * max(1, self.facts.world_size),
            slots=self._slots(),
        )
        self.compactions += 1
        self._next_compaction = max(self.compact_records, self.facts.records + self.compact_records)

    async def _compact(self) -> None:
        """Plan here, write in a thread, swap here: appends go on meanwhile."""
        try:
            if not self.healthy:
                return
            plan = compaction.plan(
                self.state,
                self.facts,
                end=self.journal.size,
                floor=self.floor(),
                keep_seqs=self.keep_files * max(1, self.facts.world_size),
                slots=self._slots(),
            )
            records_at_plan = self.facts.records
            writing = asyncio.ensure_future(asyncio.to_thread(compaction.write, self.journal, plan))
            try:
                written = await asyncio.shield(writing)
            except asyncio.CancelledError:
                # The server stops: the thread still finishes its temp file; remove it then
                # (the journal itself is untouched until the swap).
                with contextlib.suppress(Exception):
                    (await writing).path.unlink(missing_ok=True)
                raise
            except OSError as exc:
                log.warning("%s: journal compaction failed (%s); retried later", self.where, exc)
                self._next_compaction = self.facts.records + self.compact_records
                return
            if not self.healthy:
                written.path.unlink(missing_ok=True)
                return
            try:
                base = self.journal.replace_with(written.path, plan.end)
            except JournalLost as exc:
                written.path.unlink(missing_ok=True)
                self._lose(str(exc))
                return
            except OSError as exc:
                written.path.unlink(missing_ok=True)
                log.warning("%s: journal compaction failed (%s); retried later", self.where, exc)
                self._next_compaction = self.facts.records + self.compact_records
                return
            compaction.apply(self.state, plan, written, base)
            self.facts.records -= records_at_plan
            # Each compaction copies the kept records: never more often than they number.
            self._next_compaction = max(self.compact_records, len(written.moved))
            self.compactions += 1
            log.info(
                "%s: journal compacted to %d bytes (seqs below %d folded)",
                self.where,
                self.journal.size,
                plan.floor,
            )
        finally:
            self._compacting = False

    async def close(self) -> None:
        await self._tasks.close()


def _errno_text(exc: OSError) -> str:
    """`[Errno 28] No space left on device`, without the file name OSError may append."""
    if exc.errno is not None and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    return str(exc)
