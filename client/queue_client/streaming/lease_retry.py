"""Leasing a stream's next file and opening it, with the retries a corrupt or lost file gets:
the same for the client's own fetches and for the fetch helper's (which opens files without
torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from queue_client import errors
from queue_client.streaming.stream_api import Finished, LeaseRef, LeaseSource
from queue_client.wire import batchqueue_pb2 as pb

Opened = TypeVar("Opened")

# Attempts at one seq whose file keeps failing to verify (or whose lease the server lost
# before the file arrived) before giving up.
CORRUPT_RETRIES = 3


def fetch_leased(
    source: LeaseSource,
    split: str,
    seq: int | None,
    carried: bool,
    deadline: float,
    open_file: Callable[[pb.Lease, LeaseRef], Opened],
    *,
    finished: Sequence[Finished] = (),
) -> Opened:
    """Lease `seq` (any file for None) and open it; a file that fails to verify is released as
    corrupt (the server quarantines it and makes it again) and leased anew. The first lease
    call carries the release of the `finished` files (LeaseSource.acquire)."""
    last: errors.BatchQueueError | None = None
    for attempt in range(CORRUPT_RETRIES):
        lease = source.acquire(split, seq, deadline, carried, finished=() if attempt else finished)
        ref = LeaseRef(lease.lease_id, source.dataset, split, lease.seq, carried)
        source.hold(ref)
        try:
            return open_file(lease, ref)
        except errors.CorruptBatchFile as exc:
            # Quarantined by the server; in deterministic mode the same seq is produced
            # again, so the rank's stream loses nothing.
            source.release(ref, pb.CORRUPT, str(exc))
            last = exc
        except (errors.UnknownLease, errors.ServerUnavailable) as exc:
            # Streaming only: the server restarted between the lease and the end of the
            # file. Nothing of it was read: give it back and lease the same file anew.
            source.release(ref, pb.RETURNED)
            last = exc
        except BaseException:
            source.release(ref, pb.RETURNED)
            raise
    assert last is not None  # the loop ran and every attempt failed
    raise type(last)(
        f"{source.dataset}/{split} seq {seq}: {CORRUPT_RETRIES} attempts in a row failed; "
        f"the last: {last}"
    )
