"""LeaseMixin: QueueClient's lease RPCs (acquire, release, renew), split out of client.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from queue_client import errors
from queue_client.streaming.fetch import FileFetcher
from queue_client.streaming.stream_api import Finished, LeaseRef
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.rpc import Rpc
from queue_client.world import World

log = logging.getLogger("queue_client")

# One AcquireLease call waits at most this long server-side; the client calls again until its
# own timeout, so a slow provider never trips the RPC deadline, and close() is never kept
# waiting longer than one slice by a prefetch that cannot be served.
_ACQUIRE_SLICE_S = 2.0
CONSUMED = pb.CONSUMED


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
    # The server releases the leases an AcquireLease carries (its last lease said so).
    carries_releases: bool = False
    _stop_renewing: threading.Event
    _renewer: threading.Thread | None

    def acquire(
        self,
        split: str,
        seq: int | None,
        deadline: float,
        carried: bool = False,
        reacquire: bool = False,
        *,
        finished: Sequence[Finished] = (),
    ) -> pb.Lease:
        """Lease `seq` of `split` (the rank's next file for None), waiting for it until
        `deadline`. `finished` are files read to their end: the call carries their releases
        (one RPC for both) where the server takes them, and releases them itself otherwise,
        also when the lease fails."""
        riding = [
            (f.ref, r)
            for f in finished
            if (r := self._release_request(f.ref, CONSUMED, "", f.waited_s)) is not None
        ]
        if riding and not self.carries_releases:
            self._release_all(riding)
            riding = []
        try:
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
                    releases=[r for _, r in riding],
                )
                if seq is not None:
                    request.seq = seq
                try:
                    lease = self._rpc.call("AcquireLease", request, timeout_s=_ACQUIRE_SLICE_S + 10)
                except errors.NoBatchReady as exc:
                    # Released or not by that call, the releases go out on their own now
                    # (the server answers a second release of a lease as done): no release
                    # waits for a file that is slow to come.
                    self._release_all(riding)
                    riding = []
                    if time.monotonic() >= deadline:
                        raise errors.NoBatchReady(
                            f"no batch of {self.dataset}/{split} from {self.address} within {self.timeout_s:.0f}s "
                            f"(rank {self.world.rank}/{self.world.world_size}): {exc}"
                        ) from None
                    continue
                self.carries_releases = lease.carries_releases
                self._note_skips(split, lease.skips)
                done = set(lease.released)
                self._release_all([(ref, r) for ref, r in riding if r.lease_id not in done])
                riding = []
                return lease
        except BaseException:
            self._release_all(riding)
            raise

    def _note_skips(self, split: str, skips: Sequence[pb.StepRange]) -> None:
        """The split's skipped steps, as a lease reply gave them (QueueClient applies them)."""

    def _release_all(self, releases: Sequence[tuple[LeaseRef, pb.ReleaseLeaseRequest]]) -> None:
        """Send releases one by one; a failure is logged, as a finished file's release is
        (the lease then expires and the file is read again by the same rank)."""
        for ref, request in releases:
            try:
                self._send_release(ref, request)
            except errors.BatchQueueError as exc:
                log.warning(
                    "releasing %s/%s seq %d failed: %s", ref.dataset, ref.split, ref.seq, exc
                )

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
        request = self._release_request(ref, outcome, reason, waited_s)
        if request is not None:
            self._send_release(ref, request)

    def _release_request(
        self, ref: LeaseRef, outcome: pb.ReleaseOutcome, reason: str, waited_s: float
    ) -> pb.ReleaseLeaseRequest | None:
        """Take `ref` off the held leases (no longer renewed): the request that releases it,
        or None if it was released before."""
        with self._held_lock:
            self._held.pop(id(ref), None)
            if ref.released:
                return None
            ref.released = True
        return pb.ReleaseLeaseRequest(
            lease_id=ref.lease_id,
            client_id=self.client_id,
            outcome=outcome,
            reason=reason,
            waited_s=waited_s,
        )

    def _send_release(self, ref: LeaseRef, request: pb.ReleaseLeaseRequest) -> None:
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
