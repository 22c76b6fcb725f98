"""LeaseMixin: QueueClient's lease RPCs (acquire, release, renew), split out of client.py."""

from __future__ import annotations

import logging
import threading
import time

from queue_client import errors
from queue_client.fetch import FileFetcher
from queue_client.rpc import Rpc
from queue_client.stream_api import LeaseRef
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.world import World

log = logging.getLogger("queue_client")

# One AcquireLease call waits at most this long server-side; the client calls again until its
# own timeout, so a slow provider never trips the RPC deadline, and close() is never kept
# waiting longer than one slice by a prefetch that cannot be served.
_ACQUIRE_SLICE_S = 2.0


class LeaseMixin:
    """The lease side of QueueClient (called from the prefetch thread); QueueClient sets the state."""

    address: str
    dataset: str
    world: World
    timeout_s: float
    mode: str
    client_id: str
    _rpc: Rpc
    _fetcher: FileFetcher
    _closing: bool
    _lease_ttl_s: float
    _held: dict[int, LeaseRef]
    _held_lock: threading.Lock
    _stop_renewing: threading.Event
    _renewer: threading.Thread | None

    def acquire(
        self,
        split: str,
        seq: int | None,
        deadline: float,
        carried: bool = False,
        reacquire: bool = False,
    ) -> pb.Lease:
        while True:
            # A closing client leases nothing new; taking back a lease the server lost (it
            # restarted) goes on, since that is how a closing client gives the file back.
            if self._closing and not reacquire:
                raise errors.InvalidRequest(f"the QueueClient for {self.dataset!r} was closed")
            remaining = deadline - time.monotonic()
            request = pb.AcquireLeaseRequest(
                dataset=self.dataset,
                split=split,
                rank=self.world.rank,
                world_size=self.world.world_size,
                client_id=self.client_id,
                wait_ms=int(max(1, min(remaining, _ACQUIRE_SLICE_S)) * 1000),
                carried=carried,
                reacquire=reacquire,
            )
            if seq is not None:
                request.seq = seq
            try:
                return self._rpc.call("AcquireLease", request, timeout_s=_ACQUIRE_SLICE_S + 10)
            except errors.NoBatchReady as exc:
                if time.monotonic() >= deadline:
                    raise errors.NoBatchReady(
                        f"no batch of {self.dataset}/{split} from {self.address} within {self.timeout_s:.0f}s "
                        f"(rank {self.world.rank}/{self.world.world_size}): {exc}"
                    ) from None

    def files_ahead_allowed(self, split: str) -> int | None:
        """How many files this rank may hold beyond the one it reads before leasing the next
        waits for a release: in deterministic mode the server makes a rank's files only
        within max_backlog_files + 2 of its seqs (the stats say the split's own). None where
        nothing bounds it (best effort); 0 if the server does not say."""
        if self.mode != "deterministic":
            return None
        try:
            reply = self._rpc.call(
                "GetStats", pb.GetStatsRequest(dataset=self.dataset), timeout_s=self.timeout_s
            )
        except errors.BatchQueueError as exc:
            log.warning(
                "no read-ahead beyond prefetch_files for %s/%s: %s", self.dataset, split, exc
            )
            return 0
        for stats in reply.splits:
            if stats.split == split and stats.max_backlog_files > 0:
                return int(stats.max_backlog_files) + 1
        return 0

    def fetch_file(self, ref: LeaseRef, lease: pb.Lease) -> bytes:
        """The leased file's bytes, streamed and verified (transport "grpc")."""
        where = f"{lease.path} from {self.address}"
        return self._fetcher.fetch(ref.lease_id, lease.size_bytes, lease.crc32, where)

    def hold(self, ref: LeaseRef) -> None:
        with self._held_lock:
            self._held[id(ref)] = ref
        if self._renewer is None:
            self._renewer = threading.Thread(
                target=self._renew_loop, name="queue-client-renew", daemon=True
            )
            self._renewer.start()

    def release(
        self, ref: LeaseRef, outcome: pb.ReleaseOutcome, reason: str = "", waited_s: float = 0.0
    ) -> None:
        with self._held_lock:
            self._held.pop(id(ref), None)
            if ref.released:
                return
            ref.released = True
        request = pb.ReleaseLeaseRequest(
            lease_id=ref.lease_id,
            client_id=self.client_id,
            outcome=outcome,
            reason=reason,
            waited_s=waited_s,
        )
        try:
            self._rpc.call("ReleaseLease", request)
        except errors.UnknownLease:
            # Lost (the server restarted): take it again under this client, then release.
            lease = self.acquire(
                ref.split, ref.seq, time.monotonic() + self.timeout_s, ref.carried, reacquire=True
            )
            request.lease_id = lease.lease_id
            self._rpc.call("ReleaseLease", request)

    def _renew_loop(self) -> None:
        while not self._stop_renewing.wait(self._lease_ttl_s / 3):
            with self._held_lock:
                refs = [r for r in self._held.values() if not r.released]
            if not refs:
                continue
            request = pb.RenewLeasesRequest(
                client_id=self.client_id, lease_ids=[r.lease_id for r in refs]
            )
            try:
                reply = self._rpc.call("RenewLeases", request)
            except errors.BatchQueueError as exc:
                log.warning("renewing leases at %s failed: %s", self.address, exc)
                continue
            lost = set(reply.lost_lease_ids)
            for ref in refs:
                if ref.lease_id in lost and not ref.released and self.mode == "deterministic":
                    self._reacquire(ref)

    def _reacquire(self, ref: LeaseRef) -> None:
        """After a server restart the file is still ours: lease the same seq again."""
        try:
            lease = self.acquire(
                ref.split, ref.seq, time.monotonic() + self.timeout_s, ref.carried, reacquire=True
            )
        except errors.BatchQueueError as exc:
            log.warning(
                "re-acquiring %s/%s seq %d failed: %s", ref.dataset, ref.split, ref.seq, exc
            )
            return
        with self._held_lock:
            ref.lease_id = lease.lease_id
            released_meanwhile = ref.released
        if released_meanwhile:
            # The trainer finished with the file while we re-took it: end the new lease the
            # same way, or it would expire and put a consumed seq back on disk.
            request = pb.ReleaseLeaseRequest(
                lease_id=lease.lease_id, client_id=self.client_id, outcome=pb.CONSUMED
            )
            try:
                self._rpc.call("ReleaseLease", request)
            except errors.BatchQueueError as exc:
                log.warning(
                    "releasing re-acquired %s/%s seq %d failed: %s",
                    ref.dataset,
                    ref.split,
                    ref.seq,
                    exc,
                )
