"""A file leaving a split: consumed (deleted) or corrupt (moved to quarantine, its reason beside it).

Journal first, memory after: the record is appended before anything changes, so one that cannot
be written leaves the file, its lease and the split as they were. The file itself goes in a
thread; until it is gone its seq is in `state.leaving`, and production waits for that, so the
files on disk never exceed the windows, not even for a moment.

A CONSUMED release that cannot be journaled (a full disk) is refused all the same, but kept:
once the journal can be written again (the keeper probes it and recovers by itself) it is
journaled and the file deleted, whether or not its client sends it again meanwhile; sent again
after that, it is answered as done. A kept release dies with the server; what then brings such
a file to its end is its rank reading on: the files a rank read past (read_past.py) are
journaled as consumed and deleted when it consumes its next file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from queue_client import errors
from queue_client.format.layout import reason_file
from queue_server.background import BackgroundTasks
from queue_server.journal.records import Consumed, Quarantined, Record
from queue_server.production.producer import Production
from queue_server.signal import Signal
from queue_server.split import read_past
from queue_server.split.leases import Lease, LeaseTable
from queue_server.split.schedule import Schedule
from queue_server.split.state import FileEntry, KeptRelease, SplitState

log = logging.getLogger("queue_server.split")


class RemovingSplit(Protocol):
    """What taking a file out of a split reads and changes of it (SplitQueue implements it)."""

    where: str
    dir: Path
    quarantine: Path
    is_candidates: bool  # a curriculum's candidates: read in the composer's order
    state: SplitState
    schedule: Schedule
    leases: LeaseTable
    production: Production
    changed: Signal  # notified when the journal can be written again
    tasks: BackgroundTasks  # deletes, moves and the kept releases' journaling run here

    def append_record(self, record: Record) -> None:
        """Journal a record before it takes effect (ServerUnavailable if it cannot be)."""
        ...

    def note_released(self, lease_id: str, client_id: str) -> None:
        """Remember a release as done, so that the same release sent again is answered so."""
        ...


def consume(queue: RemovingSplit, lease: Lease, entry: FileEntry, why: str) -> None:
    """The leased file was read to its end: journaled, its lease dropped, the file deleted.
    A release the journal has no room for raises ServerUnavailable, and is kept."""
    try:
        queue.append_record(Consumed(lease.seq, lease.world_size))
    except errors.ServerUnavailable as exc:
        _keep_release(queue, lease)
        raise errors.ServerUnavailable(
            f"{exc} (or not: this release is kept, and journaled by the server once the "
            "journal can be written)"
        ) from None
    queue.leases.drop(lease, why)
    _consumed(queue, entry, lease.rank)
    _settle_read_past(queue, lease.rank)


def _consumed(queue: RemovingSplit, entry: FileEntry, rank: int) -> None:
    """Journaled as consumed by `rank`: out of the split's memory, then off the disk."""
    state = queue.state
    del state.files[entry.seq]
    state.consumed.add(entry.seq)
    state.kept_releases.pop(entry.seq, None)
    state.counters.consumed_files += 1
    queue.schedule.note_consumed(rank, entry.seq)
    path = queue.dir / entry.name
    _off_disk(queue, entry.seq, lambda: path.unlink(missing_ok=True))


# ---- releases the journal never heard of ---------------------------------------------------
def _keep_release(queue: RemovingSplit, lease: Lease) -> None:
    """Keep a CONSUMED release the journal had no room for, to journal it once it has."""
    kept = queue.state.kept_releases
    first = not kept
    kept[lease.seq] = KeptRelease(lease.lease_id, lease.client_id, lease.rank, lease.world_size)
    if first:
        queue.tasks.spawn(_journal_kept_releases(queue))


async def _journal_kept_releases(queue: RemovingSplit) -> None:
    """Wait (on the split's changes: a recovered journal notifies them) until the journal can
    be written, then journal every kept release; again if the journal fails meanwhile."""
    state = queue.state
    while state.kept_releases:
        if state.journal_error:
            await queue.changed.wait(None)
            continue
        for seq, kept in list(state.kept_releases.items()):
            if not _journal_kept(queue, seq, kept):
                break
        queue.changed.notify()
        queue.production.kick()


def _journal_kept(queue: RemovingSplit, seq: int, kept: KeptRelease) -> bool:
    """Journal one kept release and delete its file; False if the journal failed again."""
    state = queue.state
    entry = state.files.get(seq)
    holder = queue.leases.holder(seq)
    if entry is None or (holder is not None and holder.lease_id != kept.lease_id):
        del state.kept_releases[seq]  # gone meanwhile, or leased again: its reader decides
        return True
    try:
        queue.append_record(Consumed(seq, kept.world_size))
    except errors.ServerUnavailable:
        return False
    if holder is not None:
        queue.leases.drop(holder, "released as CONSUMED (journaled once the journal had room)")
    queue.note_released(kept.lease_id, kept.client_id)  # sent again, it is done
    log.info("%s seq %d: its release journaled once the journal had room", queue.where, seq)
    _consumed(queue, entry, kept.rank)
    _settle_read_past(queue, kept.rank)
    return True


def _settle_read_past(queue: RemovingSplit, rank: int) -> None:
    """`rank` consumed a file: journal as consumed, and delete, its files it read past before
    the split opened (read_past.py). Nothing to do once each of its files that were on disk at
    the start has been leased or has gone: the usual case, from its first files on."""
    state, schedule = queue.state, queue.schedule
    candidates = state.read_past_candidates.get(rank)
    if candidates is None:
        return
    if (
        not schedule.deterministic
        or queue.is_candidates  # read in the composer's order, not in seq order
        or schedule.world_size != state.read_past_world
    ):
        state.read_past_candidates.clear()
        return
    for seq in list(candidates):
        if seq not in state.files or seq in state.leaving or queue.leases.holder(seq) is not None:
            candidates.discard(seq)  # gone, or leased since the start: its reader decides
    if not candidates:
        del state.read_past_candidates[rank]
        return
    last = schedule.last_consumed.get(rank, -1)
    if not any(seq < last for seq in candidates):
        return
    done: list[int] = []
    for seq in read_past.read_past(schedule, candidates, queue.leases.lowest_held()):
        try:
            queue.append_record(Consumed(seq, schedule.world_size))
        except errors.ServerUnavailable:
            break  # looked at again at its next consumption
        candidates.discard(seq)
        _consumed(queue, state.files[seq], rank)
        done.append(seq)
    if done:
        log.warning(
            "%s: seqs %s deleted as consumed: rank %d consumed later seqs of its own, and "
            "their releases never reached the journal before the server restarted",
            queue.where,
            ", ".join(map(str, done)),
            rank,
        )


def quarantine(queue: RemovingSplit, entry: FileEntry, reason: str) -> None:
    """Move a file aside with its reason; in deterministic mode its seq is produced again."""
    queue.append_record(Quarantined(entry.seq, reason[:500]))
    queue.state.files.pop(entry.seq, None)
    queue.state.quarantined.add(entry.seq)
    queue.state.counters.quarantined_files += 1
    src, dst = queue.dir / entry.name, queue.quarantine / entry.name

    def move() -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.move(src, dst)
            reason_file(dst).write_text(reason + "\n", encoding="utf-8")

    _off_disk(queue, entry.seq, move)
    if queue.schedule.deterministic:
        queue.production.make_again(entry.seq)
    log.warning("%s seq %d quarantined: %s", queue.where, entry.seq, reason)


def _off_disk(queue: RemovingSplit, seq: int, remove: Callable[[], None]) -> None:
    """Run `remove` in a thread, seq marked leaving until it is done; then production runs on."""
    queue.state.leaving.add(seq)

    async def run() -> None:
        try:
            await asyncio.to_thread(remove)
        finally:
            queue.state.leaving.discard(seq)
            queue.production.kick()

    queue.tasks.spawn(run())
