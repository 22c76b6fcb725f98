"""What a split's stream gives back to the server, and when: the files it read to their end
(their releases carried on the next lease, or sent on their own), the files of a batch that
failed, the prefetched files, and everything at close. A mixin of SplitStream (stream.py)."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future

from queue_client import errors
from queue_client.streaming.lane import Lane
from queue_client.streaming.rows import LoadedFile
from queue_client.streaming.stream_api import Finished, LeaseSource
from queue_client.wire import batchqueue_pb2 as pb

log = logging.getLogger("queue_client")

CONSUMED, RETURNED = pb.CONSUMED, pb.RETURNED


class StreamReleases:
    """SplitStream's giving back; SplitStream sets the state."""

    source: LeaseSource
    split: str
    timeout_s: float
    current: LoadedFile | None
    row: int
    _finished: list[LoadedFile]
    _pending: deque[tuple[Future[LoadedFile], tuple[int, int] | None]]
    _plan: deque[tuple[int, int]]
    _next_seq: int | None
    _lane: Lane

    def _rewind(
        self, first: LoadedFile | None, first_row: int, read: list[tuple[LoadedFile, int]]
    ) -> None:
        """Undo a batch that failed to open a file, so its rows are read again on the next
        call. _advance already put the file that failed, and those after it, back in line."""
        cur = self.current
        if cur is first:  # no file was opened: nothing was given up
            self.row = first_row
            return
        if self._next_seq is None:  # best effort: any file serves; those rows are gone
            log.warning(
                "%s/%s: a batch failed after reading %d file(s); its rows are not served",
                self.source.dataset, self.split, len(read),
            )  # fmt: skip
            return
        read_ids = {id(f) for f, _ in read}
        for f in self._finished:  # not handed to a release yet: unread, as the server knows
            if id(f) in read_ids:
                self._give_back(f, RETURNED)
        self._finished = [f for f in self._finished if id(f) not in read_ids]
        if cur is not None:
            self._give_back(cur, RETURNED)
        self.current, self.row = None, 0
        self._plan.extendleft(reversed([(f.seq, row) for f, row in read]))

    def _give_back(self, f: LoadedFile, outcome: pb.ReleaseOutcome, waited_s: float = 0.0) -> None:
        """Release file `f`'s lease now, in this thread (a fetch helper's stream overrides
        this: its files are leased by the helper)."""
        self.source.release(f.lease, outcome, waited_s=waited_s)

    def _release_finished(self, old: LoadedFile) -> None:
        """A lane job: release a file read to its end."""
        self._release_consumed(Finished(old.lease, old.waited_s))

    def _release_consumed(self, done: Finished) -> None:
        ref = done.ref
        try:
            self.source.release(ref, CONSUMED, waited_s=done.waited_s)
        except errors.BatchQueueError as exc:
            log.warning("releasing %s/%s seq %d failed: %s", ref.dataset, ref.split, ref.seq, exc)

    def _give_back_pending(
        self, first: tuple[int, int] | None = None, skipped: frozenset[int] = frozenset()
    ) -> None:
        """Return every prefetched file unread and put them (after `first`) back in line;
        those in `skipped` (steps skipped past them, skipping.py) are released as consumed."""
        items = [first] if first is not None else []
        while self._pending:
            job, item = self._pending.popleft()
            if item is not None:
                items.append(item)
            if job.cancel():
                continue
            try:
                loaded = job.result(timeout=self.timeout_s)
            except BaseException:
                continue
            self.source.release(loaded.lease, CONSUMED if loaded.seq in skipped else RETURNED)
        self._plan.extendleft(reversed(items))

    def close(self, skipped: frozenset[int] = frozenset()) -> None:
        """Give back what this stream holds: a finished file as consumed, the rest unread
        (but the files in `skipped`, whose rows a skip of steps passed over: consumed).
        The releases already handed to the background are done when this returns. A
        server that cannot be reached ends the giving back at its first failed call (which
        raises), and the stream's threads end all the same."""
        try:
            self._give_back_pending(skipped=skipped)
            self._lane.close()
            finished, self._finished = self._finished, []
            for old in finished:
                self._give_back(old, CONSUMED)
            cur, self.current = self.current, None
            if cur is not None:
                done = self.row >= cur.rows or cur.seq in skipped
                self._give_back(cur, CONSUMED if done else RETURNED)
        finally:
            self._lane.close()  # idempotent
            self._finished, self.current, self.row = [], None, 0
