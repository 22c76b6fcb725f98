"""What a split's stream shares with its client: the lease it holds (LeaseRef), the snapshot
it gives of where it stands (StreamView), and what it needs from the client (LeaseSource)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from queue_client.wire import batchqueue_pb2 as pb


@dataclass
class LeaseRef:
    """A lease the client holds; lease_id changes if the lease is re-acquired after a loss."""

    lease_id: str
    dataset: str
    split: str
    seq: int
    carried: bool = False
    released: bool = False


@dataclass(frozen=True)
class Finished:
    """A file read to its end, to release as consumed: its lease, and how long get_batch
    waited for the file (the server's wait histogram)."""

    ref: LeaseRef
    waited_s: float = 0.0


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
    row: int = 0  # the next row's index in that file (offset counts batches of the file's unit)
    rows_in_file: int = 0
    read_ahead: int = 0  # files the stream keeps leased and loaded ahead (readahead.py)
    ready_ahead: int = 0  # of those, the ones loaded, in reading order, up to the first not

    @classmethod
    def of(
        cls,
        split: str,
        file: tuple[int, int, int, int] | None,
        row: int,
        done: list[bool],
        depth: int,
    ) -> StreamView:
        """The view of a stream reading `file` (seq, batches, rows per batch, rows; None
        for none) at `row`, whose files read ahead are done or not, in reading order."""
        next_file: Literal["none", "loading", "ready"] = (
            "none" if not done else "ready" if done[0] else "loading"
        )
        ready = done.index(False) if False in done else len(done)
        if file is None:
            return cls(split, None, 0, 0, next_file, 0, 0, depth, ready)
        seq, batches, batch_size, rows = file
        offset = -(-row // batch_size)  # a batch begun counts as read
        return cls(split, seq, offset, batches, next_file, row, rows, depth, ready)

    @property
    def opens_file(self) -> bool:
        """The next get_batch opens a file (the first one, or the one after this): its
        file has no row left. A batch that takes the file's last rows and the next file's
        first also opens one; `needs_file(batch_size)` says so for a given size."""
        if self.rows_in_file:
            return self.row >= self.rows_in_file
        return self.offset >= self.batches_in_file

    def needs_file(self, batch_size: int) -> bool:
        """A get_batch of `batch_size` rows opens a file."""
        return self.row + batch_size > self.rows_in_file


class LeaseSource(Protocol):
    """What a stream needs from its client; implemented by QueueClient."""

    dataset: str
    data_root: Path
    batch_size: int  # the default batch a trainer gets
    file_batch_size: int  # the files' unit: rows per stored batch
    verify_checksums: bool
    transport: str  # "file" or "grpc"
    carries_releases: bool  # the server releases the leases an AcquireLease carries

    def acquire(
        self,
        split: str,
        seq: int | None,
        deadline: float,
        carried: bool = False,
        *,
        finished: Sequence[Finished] = (),
    ) -> pb.Lease: ...  # pragma: no cover
    def hold(self, ref: LeaseRef) -> None: ...  # pragma: no cover
    def fetch_file(self, ref: LeaseRef, lease: pb.Lease) -> bytes: ...  # pragma: no cover
    def files_ahead_allowed(self, split: str) -> int | None: ...  # pragma: no cover
    def release(
        self, ref: LeaseRef, outcome: pb.ReleaseOutcome, reason: str = "", waited_s: float = 0.0
    ) -> None: ...  # pragma: no cover
