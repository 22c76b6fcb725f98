"""A file leaving a split: consumed (deleted) or corrupt (moved to quarantine, its reason beside it).

Journal first, memory after: the record is appended before anything changes, so one that cannot
be written leaves the file, its lease and the split as they were. The file itself goes in a
thread; until it is gone its seq is in `state.leaving`, and production waits for that, so the
files on disk never exceed the windows, not even for a moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from queue_client.layout import reason_file
from queue_server.journal.records import Consumed, Quarantined
from queue_server.split.leases import Lease
from queue_server.split.state import FileEntry

if TYPE_CHECKING:
    from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server.split")


def consume(queue: SplitQueue, lease: Lease, entry: FileEntry, why: str) -> None:
    """The leased file was read to its end: journaled, its lease dropped, the file deleted."""
    queue.append_record(Consumed(lease.seq, lease.world_size))
    queue.leases.drop(lease, why)
    del queue.state.files[lease.seq]
    queue.state.consumed.add(lease.seq)
    queue.state.counters.consumed_files += 1
    queue.schedule.note_consumed(lease.rank, lease.seq)
    path = queue.dir / entry.name
    _off_disk(queue, entry.seq, lambda: path.unlink(missing_ok=True))


def quarantine(queue: SplitQueue, entry: FileEntry, reason: str) -> None:
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


def _off_disk(queue: SplitQueue, seq: int, remove: Callable[[], None]) -> None:
    """Run `remove` in a thread, seq marked leaving until it is done; then production runs on."""
    queue.state.leaving.add(seq)

    async def run() -> None:
        try:
            await asyncio.to_thread(remove)
        finally:
            queue.state.leaving.discard(seq)
            queue.production.kick()

    queue.tasks.spawn(run())
