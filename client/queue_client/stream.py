"""One split's stream of batches for one rank: the file being read, and the next one coming.

get_batch's steady state is a list lookup: the background thread made each batch's views of
the memory-mapped file once per file (`unbind`). What happens next depends on where the batch
goes (transfer.py). A trainer that takes zero-copy CPU views gets views of the served fields:
of the file itself when it stores them as served (format version 1, or a plain schema),
else of the file decoded once in the background thread, so that call makes no RPC, no
syscall, no per-sample loop and no torch call, and the trainer never hands the GIL to the
client's own threads in the middle of a step. Copies (`out=`, copy=True, CUDA) start from the
stored tensors instead, narrow token ids and all, and widen them on the way (storage.py).
At a file boundary the prefetched file (leased, verified and paged in by a background thread)
takes over, the finished one is released in the background, and the prefetch of the one after
starts.

With transport "grpc" the background thread streams the file instead of mapping it
(fetch.py); the tensors then live in memory, and the hot path is the same.
"""

from __future__ import annotations

import math
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from queue_client import errors
from queue_client.batchfile import BatchFile, file_crc32, load_batch_bytes, load_batch_file
from queue_client.layout import DatasetLayout
from queue_client.resume import StreamPlan
from queue_client.schema import FieldSpec, is_xy, torch_dtype
from queue_client.storage import BatchCodec, codec_for
from queue_client.transfer import StoredBatch, Transfer
from queue_client.wire import batchqueue_pb2 as pb

CONSUMED, RETURNED, CORRUPT = pb.CONSUMED, pb.RETURNED, pb.CORRUPT
# Attempts at one seq whose file keeps failing to verify (or whose lease the server lost
# before the file arrived) before giving up.
_CORRUPT_RETRIES = 3


@dataclass
class LeaseRef:
    """A lease the client holds; lease_id changes if the lease is re-acquired after a loss."""

    lease_id: str
    dataset: str
    split: str
    seq: int
    carried: bool = False
    released: bool = False


@dataclass
class LoadedFile:
    lease: LeaseRef
    seq: int
    num_batches: int
    codec: BatchCodec  # how this file stores the schema's fields
    stored: list[torch.Tensor]  # codec.stored_names order, each [num_batches, ...]
    batches: list[StoredBatch]  # per batch, its views of the stored tensors
    # Per batch, the served fields as views (schema order): the file's own tensors when it
    # stores them as served, else the file decoded at once; None until a trainer asks.
    served: list[list[torch.Tensor]] | None = None
    start: int = 0  # the first batch to serve: later than 0 when resuming mid-file
    waited_s: float = 0.0  # how long get_batch blocked for this file

    def decode(self, served: list[tuple[torch.Size, torch.dtype]]) -> list[list[torch.Tensor]]:
        """Per batch, the served fields as views of the whole file decoded once (`served`: each
        field's batch shape and dtype). The stored views go: what is served comes from the
        decoded file from now on, and the map is let go (its pages would count twice in the
        client's memory)."""
        if self.served is None:
            codec = self.codec
            fields = [_anonymous((self.num_batches, *shape), dtype) for shape, dtype in served]
            codec.serve_into(codec.field_views(self.stored), self.stored, fields)
            self.served = [list(b) for b in zip(*(t.unbind(0) for t in fields), strict=True)]
            self.stored, self.batches = [], []
        return self.served


@dataclass(frozen=True)
class StreamView:
    """Where one split's stream stands, as the next get_batch will find it: a snapshot for
    benchmarks and monitoring (QueueClient.stream_view); reading batches never needs it."""

    split: str
    seq: int | None  # the file being read; None before its first batch and after a close
    offset: int  # the next batch's index in that file
    batches_in_file: int  # 0 while no file is open
    # The prefetch of the file after it: "none" (not started, or prefetch is off), "loading"
    # (being leased, verified and paged in), "ready" (done: opening it costs no wait; a failed
    # prefetch is "ready" too, and the next get_batch raises its error).
    next_file: Literal["none", "loading", "ready"]

    @property
    def opens_file(self) -> bool:
        """The next get_batch opens a file: the first one, or the one after this."""
        return self.offset >= self.batches_in_file


class LeaseSource(Protocol):
    """What a stream needs from its client; implemented by QueueClient."""

    dataset: str
    data_root: Path
    batch_size: int
    verify_checksums: bool
    transport: str  # "file" or "grpc"
    executor: ThreadPoolExecutor

    def acquire(
        self, split: str, seq: int | None, deadline: float, carried: bool = False
    ) -> pb.Lease: ...  # pragma: no cover
    def hold(self, ref: LeaseRef) -> None: ...  # pragma: no cover
    def fetch_file(self, ref: LeaseRef, lease: pb.Lease) -> bytes: ...  # pragma: no cover
    def release(
        self, ref: LeaseRef, outcome: pb.ReleaseOutcome, reason: str = ""
    ) -> None: ...  # pragma: no cover
    def release_later(
        self,
        ref: LeaseRef,
        outcome: pb.ReleaseOutcome,
        waited_s: float = 0.0,
        keep: object = None,
    ) -> None: ...  # pragma: no cover


class SplitStream:
    def __init__(
        self,
        source: LeaseSource,
        split: str,
        schema: tuple[FieldSpec, ...],
        *,
        plan: StreamPlan | None,
        seq_stride: int,
        prefetch: bool,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.split = split
        self.schema = schema
        self.names = [f.name for f in schema]
        self.xy = is_xy(schema)
        self.codec = codec_for(schema)
        # Files of format version 1 hold the served fields themselves.
        self._plain_codec = codec_for(tuple(FieldSpec(f.name, f.dtype, f.shape) for f in schema))
        # What a batch is served as: (shape, dtype) per field, for checking out= buffers.
        self.served = [
            (torch.Size((source.batch_size, *f.shape)), torch_dtype(f.dtype)) for f in schema
        ]
        # Set once a trainer took zero-copy views: from then on each file is decoded in the
        # prefetch thread, so those calls stay lookups.
        self._wants_served = False
        self.stride = seq_stride
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self._clock = clock
        # Deterministic streams know their seqs; best-effort ones (plan None) take any file.
        self._plan: deque[tuple[int, int]] = deque(plan.items if plan else ())
        self._next_seq: int | None = plan.next_seq if plan else None
        self.current: LoadedFile | None = None
        self._batches: list[StoredBatch] = []
        self._served: list[list[torch.Tensor]] | None = None
        self._num_batches = 0
        self.offset = 0
        self._pending: Future[LoadedFile] | None = None
        self._pending_item: tuple[int, int] | None = None

    # ---- the hot path -------------------------------------------------------------------
    def next_batch(self, transfer: Transfer) -> list[torch.Tensor]:
        """The next batch's served fields, in schema order, as `transfer` delivers them."""
        i = self.offset
        if i >= self._num_batches:
            self._advance()
            i = self.offset
        self.offset = i + 1
        if transfer.serves_views:
            served = self._served
            if served is None:
                served = self._decode_current()
            return served[i]
        return transfer.deliver(self._batches[i])

    def next_into(self, transfer: Transfer, outs: list[torch.Tensor]) -> None:
        """Copy the next batch into `outs` (checked by the caller against `served`): from the
        stored views, widening; from the served views where the file was decoded for views."""
        i = self.offset
        if i >= self._num_batches:
            self._advance()
            i = self.offset
        self.offset = i + 1
        batches = self._batches
        if batches:
            transfer.deliver_into(batches[i], outs)
            return
        served = self._served
        assert served is not None  # a file's stored views go only once it is decoded
        for out, view in zip(outs, served[i], strict=True):
            out.copy_(view)

    def _decode_current(self) -> list[list[torch.Tensor]]:
        self._wants_served = True
        cur = self.current
        assert cur is not None
        self._served = cur.decode(self.served)
        self._batches = cur.batches
        return self._served

    # ---- file boundaries ------------------------------------------------------------------
    def _take(self) -> tuple[int | None, int, bool]:
        """The next file to read: (seq, first batch, carried over from a plan?)."""
        if self._plan:
            planned, offset = self._plan.popleft()
            return planned, offset, True
        seq = self._next_seq
        if seq is not None:
            self._next_seq = seq + self.stride
        return seq, 0, False

    def _submit(self) -> Future[LoadedFile]:
        seq, offset, carried = self._take()
        self._pending_item = None if seq is None else (seq, offset)
        return self.source.executor.submit(self._fetch, seq, offset, carried)

    def _advance(self) -> None:
        old = self.current
        self.current = None
        pending = self._pending if self._pending is not None else self._submit()
        self._pending = None
        began = self._clock()
        try:
            loaded = pending.result()
        except BaseException:
            # Nothing of that file was read: keep it first in line, so a retried get_batch
            # asks for the same file again instead of skipping it.
            if self._pending_item is not None:
                self._plan.appendleft(self._pending_item)
                self._pending_item = None
            raise
        waited = self._clock() - began
        loaded.waited_s = waited
        self.current = loaded
        self._batches = loaded.batches
        self._served = loaded.served
        if old is not None:
            # The release job holds the finished file last, so it is unmapped off this thread.
            self.source.release_later(old.lease, CONSUMED, old.waited_s, keep=old)
            del old
        self._num_batches = loaded.num_batches
        self.offset = min(loaded.start, loaded.num_batches)
        self._pending_item = None
        if self.prefetch:
            self._pending = self._submit()
        if self.offset >= self._num_batches:  # a resume exactly at a file's end
            self._advance()

    def _fetch(self, seq: int | None, start: int, carried: bool) -> LoadedFile:
        deadline = self._clock() + self.timeout_s
        last: errors.BatchQueueError | None = None
        for _attempt in range(_CORRUPT_RETRIES):
            lease = self.source.acquire(self.split, seq, deadline, carried)
            ref = LeaseRef(lease.lease_id, self.source.dataset, self.split, lease.seq, carried)
            self.source.hold(ref)
            try:
                loaded = self._open(lease, ref)
            except errors.CorruptBatchFile as exc:
                # Quarantined by the server; in deterministic mode the same seq is produced
                # again, so the rank's stream loses nothing.
                self.source.release(ref, CORRUPT, str(exc))
                last = exc
                continue
            except (errors.UnknownLease, errors.ServerUnavailable) as exc:
                # Streaming only: the server restarted between the lease and the end of the
                # file. Nothing of it was read: give it back and lease the same file anew.
                self.source.release(ref, RETURNED)
                last = exc
                continue
            except BaseException:
                self.source.release(ref, RETURNED)
                raise
            loaded.start = start
            return loaded
        assert last is not None  # the loop ran and every attempt failed
        raise type(last)(
            f"{self.source.dataset}/{self.split} seq {seq}: {_CORRUPT_RETRIES} attempts in a row "
            f"failed; the last: {last}"
        )

    def _open(self, lease: pb.Lease, ref: LeaseRef) -> LoadedFile:
        streamed = self.source.transport == "grpc"
        if streamed:
            where = f"{lease.path} (streamed)"
            batch_file = load_batch_bytes(self.source.fetch_file(ref, lease), where)
        else:
            where, batch_file = self._map(lease)
        meta = batch_file.metadata
        if meta.get("seq") != lease.seq or meta.get("num_batches") != lease.num_batches:
            raise errors.CorruptBatchFile(
                f"{where} says seq {meta.get('seq')} with {meta.get('num_batches')} batches; the lease says "
                f"seq {lease.seq} with {lease.num_batches}"
            )
        codec = self.codec if batch_file.version >= 2 else self._plain_codec
        try:
            codec.check_stored(batch_file.stored, (lease.num_batches, lease.batch_size))
        except errors.SchemaMismatch as exc:
            raise errors.SchemaMismatch(f"{where}: {exc}") from None
        tensors = [batch_file.stored[name] for name in codec.stored_names]
        if not streamed:  # streamed tensors were just written: their pages are in memory
            _prefault(tensors)
        per_tensor = [t.unbind(0) for t in tensors]
        per_field = [None if v is None else v.unbind(0) for v in codec.field_views(tensors)]
        batches = [
            StoredBatch(
                codec,
                [None if f is None else f[i] for f in per_field],
                [t[i] for t in per_tensor],
            )
            for i in range(lease.num_batches)
        ]
        loaded = LoadedFile(ref, lease.seq, lease.num_batches, codec, tensors, batches)
        if codec.identity:
            # The file holds the served fields: its views are what a trainer gets.
            loaded.served = [b.fields for b in batches]  # type: ignore[misc]
        elif self._wants_served:
            loaded.decode(self.served)
        return loaded

    def _map(self, lease: pb.Lease) -> tuple[str, BatchFile]:
        """Verify the leased file under data_root and map it: (its path, the file)."""
        root = self.source.data_root
        path = (root / lease.path).resolve()
        if not path.is_relative_to(root):
            raise errors.PermissionDenied(
                f"leased path {lease.path!r} lies outside the data root {root}"
            )
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if not DatasetLayout(root, self.source.dataset).meta_file.exists():
                # Not a bad file: this client looks in the wrong place. Nothing to quarantine.
                raise errors.InvalidRequest(
                    f"{path} is not visible here: data_root {root} does not hold the server's "
                    f"dataset {self.source.dataset!r}; pass QueueClient(data_root=...) or set "
                    "BATCHQUEUE_DATA_ROOT to where the server's data root is mounted, or "
                    'stream the files with transport="grpc" (or "auto")'
                ) from None
            raise errors.CorruptBatchFile(f"{path} is missing from the data root") from None
        if size != lease.size_bytes:
            raise errors.CorruptBatchFile(
                f"{path} has {size} bytes, the server wrote {lease.size_bytes}"
            )
        if self.source.verify_checksums:
            crc = file_crc32(path)
            if crc != lease.crc32:
                raise errors.CorruptBatchFile(
                    f"{path} has crc32 {crc:#010x}, the server wrote {lease.crc32:#010x}"
                )
        else:
            _page_in(path)
        return str(path), load_batch_file(path)

    # ---- state and shutdown ---------------------------------------------------------------
    def plan(self) -> StreamPlan:
        """What is left to read, as a plan: where a resume starts. Prefetched files count as
        unread, so a resume produces them again rather than skip them."""
        items: list[tuple[int, int]] = []
        cur = self.current
        if cur is not None and self.offset < cur.num_batches:
            items.append((cur.seq, self.offset))
        if self._pending_item is not None:
            items.append(self._pending_item)
        items.extend(self._plan)
        assert self._next_seq is not None, "best-effort streams have no plan"
        return StreamPlan(tuple(items), self._next_seq).normalized(self.stride)

    def view(self) -> StreamView:
        """A snapshot of where the stream stands; see StreamView. Cheap, and changes nothing."""
        pending, cur = self._pending, self.current
        next_file: Literal["none", "loading", "ready"] = (
            "none" if pending is None else "ready" if pending.done() else "loading"
        )
        seq = None if cur is None else cur.seq
        return StreamView(self.split, seq, self.offset, self._num_batches, next_file)

    def close(self) -> None:
        """Give back what this stream holds: a finished file as consumed, the rest unread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                loaded = pending.result(timeout=self.timeout_s)
            except BaseException:
                loaded = None
            if loaded is not None:
                self.source.release(loaded.lease, RETURNED)
        cur, self.current = self.current, None
        if cur is not None:
            self.source.release(cur.lease, CONSUMED if self.offset >= cur.num_batches else RETURNED)
        self._batches, self._served, self._num_batches, self.offset = [], None, 0, 0


def _anonymous(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in memory of its own (an anonymous map), given back to the
    system the moment its last view goes. A file decoded into malloc'd memory instead leaves
    the allocator's heap holding several files' worth once a few have come and gone."""
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


def _prefault(tensors: list[torch.Tensor]) -> None:
    """Read one element per page of each mapped tensor, here in the prefetch thread, so the
    trainer's first touch of a batch finds its pages mapped (no minor faults in get_batch)."""
    for t in tensors:
        flat = t.reshape(-1)
        step = max(1, 4096 // max(1, t.element_size()))
        flat[::step].to(torch.int64).sum()


def _page_in(path: Path) -> None:
    """Ask the kernel to read the file ahead, so the first batches cost no I/O."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
