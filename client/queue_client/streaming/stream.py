"""One split's stream of batches for one rank: the file being read, and the next one coming.

A file is a run of rows (rows.py): get_batch(split, batch_size=B) takes the next B rows,
from the end of one file and the start of the next where it must, so a trainer picks its own
batch size, and changes it, whatever the files' unit. In steady state a call slices the
mapped file and widens those rows into the tensors it returns (one copy_ per field): no RPC,
no syscall, no per-sample loop. Zero-copy CPU trainers get views of the file where it stores
the served fields, else the rows widened into a batch's own memory; copies (`out=`, copy=True, CUDA) start from the
stored tensors, narrow token ids and all, and widen them on the way (storage.py).
Leasing, crc32, loading and paging in all happen in the stream's background threads
(lane.py), `prefetch_files` ahead (deeper for a trainer that reads files faster than they are
fetched: readahead.py), and cost the file switch next to nothing: the prefetched file takes
over with its first batch already widened (for zero-copy CPU batches of the size the trainer
last took at a switch), and the fetch of the next file is handed to those threads with one
queue put, its lease call carrying the finished file's release (stream_release.py).

With transport "grpc" the background thread streams the file instead of mapping it
(fetch.py); the tensors then live in memory, and the hot path is the same.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch

from queue_client import errors
from queue_client.format.schema import FieldSpec, is_xy, torch_dtype
from queue_client.format.storage import codec_for
from queue_client.streaming.lane import Lane
from queue_client.streaming.leased_file import fetch_leased, open_leased
from queue_client.streaming.readahead import read_ahead_for
from queue_client.streaming.resume import StreamPlan
from queue_client.streaming.rows import MAX_BATCH_BYTES, LoadedFile, max_batch_rows, rows_dependence
from queue_client.streaming.stream_api import Finished, LeaseRef, LeaseSource, StreamView
from queue_client.streaming.stream_release import StreamReleases
from queue_client.streaming.transfer import Transfer
from queue_client.wire import batchqueue_pb2 as pb

log = logging.getLogger("queue_client")

# A stream's threads beyond its fetches in flight: releases in flight at once.
_RELEASE_THREADS = 3


class SplitStream(StreamReleases):
    def __init__(
        self,
        source: LeaseSource,
        split: str,
        schema: tuple[FieldSpec, ...],
        *,
        plan: StreamPlan | None,
        seq_stride: int,
        prefetch: int,
        timeout_s: float,
        clock: Callable[[], float],
        dependence: str = "",
    ) -> None:
        self.source = source
        self.split = split
        self.schema = schema
        self.names = [f.name for f in schema]
        self.xy = is_xy(schema)
        self.codec = codec_for(schema)
        # Files of format version 1 hold the served fields themselves.
        self._plain_codec = codec_for(tuple(FieldSpec(f.name, f.dtype, f.shape) for f in schema))
        # What a row is served as: (shape, dtype) per field.
        self.row_served = [(torch.Size(f.shape), torch_dtype(f.dtype)) for f in schema]
        self.row_bytes = sum(s.numel() * d.itemsize for s, d in self.row_served)
        self.max_rows = max_batch_rows(self.row_bytes)  # the largest batch_size served
        # Why a batch must be the file's own (empty: any size, rows cross files freely).
        self.dependence = dependence or rows_dependence({}, self.codec)
        self.stride = seq_stride
        self.prefetch = int(prefetch)  # files fetched ahead of the one being read, at least
        allowed = source.files_ahead_allowed(split) if self.prefetch else 0
        self.read_ahead = read_ahead_for(
            self.prefetch, allowed, in_memory=source.transport == "grpc"
        )
        self.timeout_s = timeout_s
        self.clock = clock
        # Deterministic streams know their seqs; best-effort ones (plan None) take any file.
        self._plan: deque[tuple[int, int]] = deque(plan.items if plan else ())
        self._next_seq: int | None = plan.next_seq if plan else None
        self.current: LoadedFile | None = None
        self.row = 0  # the next row of the current file
        # Files being prefetched, in reading order: each job and the (seq, first row) it reads
        # (None for best-effort streams).
        self._pending: deque[tuple[Future[LoadedFile], tuple[int, int] | None]] = deque()
        self._finished: list[LoadedFile] = []  # read to their end, not yet released
        self._opened_at = 0.0  # when the current file served its first rows
        # Rows of zero-copy batches the trainer took at its last switch: the background
        # widens a fetched file's first batch of that size ahead (0: none, for out= buffers,
        # copies and devices, which start from the stored rows).
        self._size = 0
        # Fetches in flight at the deepest read-ahead, and releases beside them: a release
        # RPC of a loaded server can outlast the reading of a file or two, and a fetch must
        # never queue behind one.
        self._lane = self._make_lane()
        # A stream dropped unclosed (its client never closed) leaves no idle threads behind.
        weakref.finalize(self, self._lane.stop)

    def _make_lane(self) -> Lane:
        return Lane(
            f"queue-client-{self.split}",
            max(1, self.read_ahead.cap) + _RELEASE_THREADS,
            f"the {self.source.dataset}/{self.split} stream",
        )

    def served(self, size: int) -> list[tuple[torch.Size, torch.dtype]]:
        """What a batch of `size` rows is served as: (shape, dtype) per field."""
        return [(torch.Size((size, *shape)), dtype) for shape, dtype in self.row_served]

    def check_size(self, size: int) -> None:
        """Refuse a batch size the stream cannot serve, naming why: one past `max_rows`, or
        any but the files' own where rows depend on their batch."""
        unit = self.source.file_batch_size
        if size == unit:
            return
        if size > self.max_rows:
            raise errors.InvalidRequest(
                f"batch_size={size} is more rows than one batch of "
                f"{self.source.dataset}/{self.split} may hold: at most {self.max_rows} "
                f"({MAX_BATCH_BYTES >> 30} GiB of served fields at {self.row_bytes} bytes a row)"
            )
        if not self.dependence:
            return
        raise errors.InvalidRequest(
            f"{self.source.dataset}/{self.split} serves batches of its files' {unit} rows "
            f"only, not batch_size={size}: {self.dependence}"
        )

    # ---- the hot path -------------------------------------------------------------------
    def next_batch(self, transfer: Transfer, size: int) -> list[torch.Tensor]:
        """The next `size` rows' served fields, in schema order, as `transfer` delivers them."""
        cur, r0 = self.current, self.row
        r1 = r0 + size
        if cur is None or r1 > cur.rows:
            return self._crossing(transfer, size)
        self.row = r1
        if transfer.serves_views:
            return cur.views(r0, r1)
        return transfer.deliver(cur.stored_batch(r0, r1))

    def next_into(self, transfer: Transfer, outs: list[torch.Tensor]) -> None:
        """Copy the next rows into `outs` (checked by the caller against `served`), widening
        narrow ids on the way; as many rows as the buffers hold."""
        size = outs[0].shape[0]
        cur, r0 = self.current, self.row
        r1 = r0 + size
        if cur is None or r1 > cur.rows:
            self._size = 0
            self._fill(size, _copier(transfer, outs))
            self._after_switch()
            return
        self.row = r1
        transfer.deliver_into(cur.stored_batch(r0, r1), outs)

    def _crossing(self, transfer: Transfer, size: int) -> list[torch.Tensor]:
        """A batch whose rows are not all in the current file: the start of the next file
        (or a first file), or the end of one file and the start of the next ones."""
        self._size = size if transfer.serves_views else 0
        cur = self.current
        if cur is None or self.row >= cur.rows:
            self._advance()  # nothing taken yet: a failure leaves the stream as it was
            cur = self.current
            assert cur is not None
            r0 = self.row
            if r0 + size <= cur.rows:  # the whole batch in the file just opened
                self.row = r0 + size
                if transfer.serves_views:
                    outs = cur.first_views(r0, r0 + size)
                else:
                    outs = transfer.deliver(cur.stored_batch(r0, r0 + size))
                del cur
                self._after_switch()
                return outs
        del cur
        device = None if transfer.serves_views else transfer.device
        outs = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.served(size)
        ]
        self._fill(size, _copier(transfer, outs))
        self._after_switch()
        return outs

    def _fill(self, size: int, put: Callable[[LoadedFile, int, int, int], None]) -> None:
        """Copy the next `size` rows with put(file, first row, end row, where they go in the
        batch), opening files as needed. A file read to its end mid-batch is released as
        soon as the next one is needed, so a batch of any size holds no more leases than the
        read-ahead does (a rank may hold only a few files at once). If opening a file fails,
        the stream goes back to the batch's first row, so a retried get_batch serves the
        same rows: files this batch already gave up are asked for again, as on a resume."""
        first, first_row, at = self.current, self.row, 0
        read: list[tuple[LoadedFile, int]] = []  # each file this batch copied from, and where
        while at < size:
            cur = self.current
            if cur is None or self.row >= cur.rows:
                try:
                    self._advance()
                except BaseException:
                    self._rewind(first, first_row, read)
                    raise
                cur = self.current
                assert cur is not None
                if size - at > cur.rows - self.row:  # more files to come: let the last ones go
                    self._after_switch()
                continue
            take = min(size - at, cur.rows - self.row)
            read.append((cur, self.row))
            put(cur, self.row, self.row + take, at)
            self.row += take
            at += take

    # ---- file boundaries ------------------------------------------------------------------
    def _take(self) -> tuple[int | None, int, bool]:
        """The next file to read: (seq, first row, carried over from a plan?)."""
        if self._plan:
            planned, offset = self._plan.popleft()
            return planned, offset, True
        seq = self._next_seq
        if seq is not None:
            self._next_seq = seq + self.stride
        return seq, 0, False

    def _submit(self) -> None:
        self._lane.put(self._fetch_job())

    def _fetch_job(self, finished: list[LoadedFile] | None = None) -> Callable[[], None]:
        """Take the next file in line as pending; the lane job that fetches it, carrying the
        release of the `finished` files on its lease call."""
        self._lane.check_open()
        seq, offset, carried = self._take()
        job: Future[LoadedFile] = Future()
        self._pending.append((job, None if seq is None else (seq, offset)))
        return partial(
            self._fetch_into, job, seq, offset, carried, self.clock(), self._size, finished or []
        )

    def _fetch_into(
        self,
        job: Future[LoadedFile],
        seq: int | None,
        start: int,
        carried: bool,
        submitted: float,
        size: int,
        finished: list[LoadedFile],
    ) -> None:
        """A lane job: fetch a file into `job`, unless the stream gave it up first, and
        release the `finished` files either way (unmapped here, off the trainer's thread)."""
        done = [Finished(f.lease, f.waited_s) for f in finished]
        finished.clear()
        if not job.set_running_or_notify_cancel():
            for f in done:
                self._release_consumed(f)
            return
        try:
            loaded = self._fetch(seq, start, carried, submitted, done)
        except BaseException as exc:
            job.set_exception(exc)
            return
        if size:
            try:
                loaded.prepare_first(size)
            except Exception:  # the switch widens the batch itself, as without this
                log.exception("widening the first batch of seq %s ahead failed", loaded.seq)
        job.set_result(loaded)

    def _advance(self) -> None:
        if not self._pending:
            self._submit()
        job, item = self._pending.popleft()
        began = self.clock()
        try:
            loaded = job.result()
        except BaseException:
            # Nothing of that file was read: keep it first in line (and the prefetched files
            # after it, given back), so a retried get_batch asks for the same files again
            # instead of skipping any.
            self._give_back_pending(item)
            raise
        now = self.clock()
        loaded.waited_s = now - began
        if self.current is not None:
            self._finished.append(self.current)
            self.read_ahead.read(now - self._opened_at)
        self._opened_at = now
        self.current = loaded
        self.row = min(loaded.start, loaded.rows)

    def _after_switch(self) -> None:
        """Release the finished files and prefetch the next ones: after the batch that
        switched files is made, so the background threads this wakes take no GIL or core
        from that call. All in one queue put (lane.py): fetches first. Where the server
        takes releases on a lease call, the first fetch carries the finished files' (one RPC
        per file, not two); else each has a release job of its own."""
        finished = list(self._finished)
        carry = list(finished) if self.source.carries_releases else []
        jobs = []
        while len(self._pending) < self.read_ahead.depth:
            jobs.append(self._fetch_job(carry))
            carry = []
        if not jobs or not self.source.carries_releases:
            jobs.extend(partial(self._release_finished, old) for old in finished)
        # The jobs hold the finished files last, so they are unmapped off this thread:
        # nothing here keeps one once the jobs are handed over.
        finished.clear()
        self._finished.clear()
        self._lane.put_all(jobs)
        jobs.clear()

    def _fetch(
        self,
        seq: int | None,
        start: int,
        carried: bool,
        submitted: float,
        finished: list[Finished],
    ) -> LoadedFile:
        deadline = self.clock() + self.timeout_s
        loaded = fetch_leased(
            self.source, self.split, seq, carried, deadline, self._open, finished=finished
        )
        loaded.start = start
        self.read_ahead.fetched(self.clock() - submitted)
        return loaded

    def _open(self, lease: pb.Lease, ref: LeaseRef) -> LoadedFile:
        return open_leased(self.source, self.codec, self._plain_codec, lease, ref)

    # ---- state and shutdown ---------------------------------------------------------------
    def plan(self) -> StreamPlan:
        """What is left to read, as a plan of (seq, first row): where a resume starts.
        Prefetched files count as unread, so a resume produces them again rather than skip
        them."""
        items: list[tuple[int, int]] = []
        cur = self.current
        if cur is not None and self.row < cur.rows:
            items.append((cur.seq, self.row))
        items.extend(item for _, item in self._pending if item is not None)
        items.extend(self._plan)
        assert self._next_seq is not None, "best-effort streams have no plan"
        return StreamPlan(tuple(items), self._next_seq).normalized(self.stride)

    def view(self) -> StreamView:
        """A snapshot of where the stream stands; see StreamView. Cheap, and changes nothing."""
        cur = self.current
        file = None if cur is None else (cur.seq, cur.num_batches, cur.batch_size, cur.rows)
        done = [job.done() for job, _ in self._pending]
        return StreamView.of(self.split, file, self.row, done, self.read_ahead.depth)


def _copier(
    transfer: Transfer, outs: list[torch.Tensor]
) -> Callable[[LoadedFile, int, int, int], None]:
    """put() for Stream._fill: rows r0..r1 of a file into `outs` from row `at` on."""
    views = transfer.serves_views

    def put(f: LoadedFile, r0: int, r1: int, at: int) -> None:
        parts = [o[at : at + r1 - r0] for o in outs]
        if views:
            f.serve_rows_into(r0, r1, parts)
        else:
            transfer.deliver_into(f.stored_batch(r0, r1), parts)

    return put
