"""Leases: which client reads which file, until when. Grant, renew, expire, release.

A lease is per file, never per batch: one RPC per file of ~100 batches disappears next to the
copies. A client renews its leases every ttl/3; one that stops (killed, hung) loses them at
expiry and its files go back to the same rank's stream. The newest client of a rank owns the
rank's stream: a restarted trainer takes over the leases of its dead predecessor at once.

Two clients that claim one rank at the same time (a launcher that gave two processes the
same RANK) would take that rank's leases from each other for ever: RankClaims notices them,
logs a WARNING once, and the stats show them until one of them stops.

Time is injected (`clock`), so expiry is tested without waiting. A LeaseDirectory finds the
table that holds a lease id, for the RPCs that name only the lease (renew, release, fetch),
and remembers the latest releases, so that a client releasing a lease again hears it is done.
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from queue_client import errors

log = logging.getLogger("queue_server.leases")

# Longest client_id or lease_id accepted: ids are uuids; anything far longer is abuse.
MAX_ID_LENGTH = 128
# Clients remembered per rank for duplicate detection: far more than one rank ever has.
_MAX_CLAIMS_PER_RANK = 16
# Leases remembered as released, server-wide, so that a client that releases one again (it
# carried the release on an AcquireLease whose answer it never got) hears it is done: far
# more than the releases of all clients in flight at once.
_RELEASES_REMEMBERED = 4096


class ReleaseOutcome(enum.IntEnum):
    """What a client says of a file it gives back; the values are the wire's (ReleaseOutcome
    in batchqueue.proto)."""

    CONSUMED = 1  # read to the end: delete it
    RETURNED = 2  # not read (the client stops): the same rank gets it again
    CORRUPT = 3  # failed to verify: quarantine it, and make the seq again


@dataclass
class Lease:
    lease_id: str
    client_id: str
    seq: int
    rank: int
    world_size: int
    expires_at: float


Owner = TypeVar("Owner")


class LeaseDirectory(Generic[Owner]):
    """Server-wide: lease id -> the owner (a split queue) whose table holds it.

    `on_discard(lease_id, why)` hears of every lease that ends (FetchFile ends the streams
    of that lease with it)."""

    def __init__(self, on_discard: Callable[[str, str], None] | None = None) -> None:
        self._owners: dict[str, Owner] = {}
        self._on_discard = on_discard
        self._released: OrderedDict[str, str] = OrderedDict()  # lease id -> its client

    def note_released(self, lease_id: str, client_id: str) -> None:
        """Remember that `client_id` released `lease_id` (the newest _RELEASES_REMEMBERED)."""
        self._released[lease_id] = client_id
        if len(self._released) > _RELEASES_REMEMBERED:
            self._released.popitem(last=False)

    def released_by(self, lease_id: str, client_id: str) -> bool:
        """`client_id` released `lease_id` lately: releasing it again changes nothing."""
        return bool(client_id) and self._released.get(lease_id) == client_id

    def add(self, lease_id: str, owner: Owner) -> None:
        self._owners[lease_id] = owner

    def discard(self, lease_id: str, why: str = "released") -> None:
        if self._owners.pop(lease_id, None) is not None and self._on_discard is not None:
            self._on_discard(lease_id, why)

    def owner_of(self, lease_id: str) -> Owner:
        if not lease_id or len(lease_id) > MAX_ID_LENGTH:
            raise errors.InvalidRequest(f"lease_id {lease_id[:MAX_ID_LENGTH]!r} is malformed")
        owner = self._owners.get(lease_id)
        if owner is None:
            raise errors.UnknownLease(
                f"lease {lease_id!r} is not held (expired, released, or the server restarted)"
            )
        return owner


@dataclass
class _Claim:
    first_seen: float
    last_seen: float


class RankClaims:
    """Which clients act for each rank (acquire or renew) and when: two clients are duplicates
    while both are live (seen within a lease TTL) and each was seen after the other first
    appeared. A restarted trainer replacing a dead one is no duplicate: the dead one was last
    seen before the new one first was."""

    def __init__(self, where: str, ttl_s: float, clock: Callable[[], float]) -> None:
        self.where = where
        self.ttl_s = ttl_s
        self._clock = clock
        self._claims: dict[int, dict[str, _Claim]] = {}
        self._warned: dict[int, frozenset[str]] = {}

    def seen(self, rank: int, client_id: str) -> None:
        now = self._clock()
        clients = self._claims.setdefault(rank, {})
        claim = clients.get(client_id)
        if claim is None:
            if len(clients) >= _MAX_CLAIMS_PER_RANK:  # keep the check cheap under abuse
                del clients[min(clients, key=lambda c: clients[c].last_seen)]
            clients[client_id] = _Claim(now, now)
        else:
            claim.last_seen = now
        duplicates = self._live_duplicates(rank, now)
        if len(duplicates) < 2:
            self._warned.pop(rank, None)
            return
        if not duplicates <= self._warned.get(rank, frozenset()):
            self._warned[rank] = duplicates
            log.warning(
                "%s: rank %d is claimed by %d live clients at once (%s): they take each "
                "other's leases; give each trainer process its own rank (RANK, WORLD_SIZE)",
                self.where,
                rank,
                len(duplicates),
                ", ".join(sorted(duplicates)),
            )

    def _live_duplicates(self, rank: int, now: float) -> frozenset[str]:
        clients = self._claims.get(rank, {})
        for client_id in [c for c, claim in clients.items() if claim.last_seen < now - self.ttl_s]:
            del clients[client_id]  # gone quiet: not live any more
        if not clients:
            self._claims.pop(rank, None)
        found: set[str] = set()
        items = list(clients.items())
        for i, (a, ca) in enumerate(items):
            for b, cb in items[i + 1 :]:
                if ca.last_seen >= cb.first_seen and cb.last_seen >= ca.first_seen:
                    found.update((a, b))
        return frozenset(found)

    def duplicates(self) -> dict[int, list[str]]:
        """rank -> the live clients that claim it together, for the ranks with more than one."""
        now = self._clock()
        out = {}
        for rank in list(self._claims):
            found = self._live_duplicates(rank, now)
            if len(found) > 1:
                out[rank] = sorted(found)
        return out


class LeaseTable:
    """The leases of one split's files."""

    def __init__(
        self,
        where: str,
        ttl_s: float,
        clock: Callable[[], float],
        on_add: Callable[[str], None] = lambda lease_id: None,
        on_remove: Callable[[str, str], None] = lambda lease_id, why: None,
    ) -> None:
        self.where = where
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_add, self._on_remove = on_add, on_remove
        self.by_id: dict[str, Lease] = {}
        self.by_seq: dict[int, Lease] = {}
        self.claims = RankClaims(where, ttl_s, clock)

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self.by_id

    def get(self, lease_id: str) -> Lease | None:
        return self.by_id.get(lease_id)

    def holder(self, seq: int) -> Lease | None:
        return self.by_seq.get(seq)

    def grant(self, seq: int, rank: int, world_size: int, client_id: str) -> Lease:
        """Lease file `seq` to a client. The same client asking again gets the same lease,
        renewed; another client of the rank takes the lease over (the newest owns the rank)."""
        self.claims.seen(rank, client_id)
        expires = self._clock() + self.ttl_s
        lease = self.by_seq.get(seq)
        if lease is not None:
            if lease.client_id == client_id:
                lease.expires_at = expires
                return lease
            log.warning(
                "%s seq %d: lease of client %s taken over by %s",
                self.where,
                seq,
                lease.client_id,
                client_id,
            )
            self.drop(lease, f"taken over by client {client_id!r} of the same rank")
        lease = Lease(uuid.uuid4().hex, client_id, seq, rank, world_size, expires)
        self.by_id[lease.lease_id] = lease
        self.by_seq[seq] = lease
        self._on_add(lease.lease_id)
        return lease

    def renew(self, lease_id: str, client_id: str) -> bool:
        lease = self.by_id.get(lease_id)
        if lease is None or lease.client_id != client_id:
            return False
        lease.expires_at = self._clock() + self.ttl_s
        self.claims.seen(lease.rank, client_id)
        return True

    def check_release(self, lease_id: str, client_id: str, outcome: int) -> Lease:
        """The lease a release names, after checking who asks and what they say."""
        lease = self.by_id.get(lease_id)
        if lease is None:
            raise errors.UnknownLease(
                f"lease {lease_id!r} of {self.where} is not held (expired, released, or the "
                "server restarted)"
            )
        if lease.client_id != client_id:
            raise errors.LeaseConflict(
                f"lease {lease_id!r} belongs to another client, not to {client_id!r}"
            )
        if outcome not in ReleaseOutcome.__members__.values():
            raise errors.InvalidRequest(
                f"release outcome {outcome} is not CONSUMED, RETURNED or CORRUPT"
            )
        return lease

    def drop(self, lease: Lease, why: str = "released") -> None:
        """End a lease; `why` (released, expired, taken over) is told to its FetchFile streams."""
        self.by_id.pop(lease.lease_id, None)
        if self.by_seq.get(lease.seq) is lease:
            del self.by_seq[lease.seq]
        self._on_remove(lease.lease_id, why)

    def expire(self) -> list[Lease]:
        """Drop the leases whose time is up; returns them."""
        now = self._clock()
        expired = [lease for lease in self.by_id.values() if lease.expires_at <= now]
        for lease in expired:
            self.drop(lease, f"expired (not renewed within lease_ttl_s = {self.ttl_s:g} s)")
            log.info(
                "%s seq %d: lease of client %s expired", self.where, lease.seq, lease.client_id
            )
        return expired

    def seconds_to_next_expiry(self) -> float | None:
        soonest = min((lease.expires_at for lease in self.by_id.values()), default=None)
        return None if soonest is None else max(0.0, soonest - self._clock())

    def lowest_held(self) -> dict[int, int]:
        """rank -> the lowest seq it holds a lease on (one pass over the leases)."""
        held: dict[int, int] = {}
        for lease in self.by_id.values():
            if lease.seq < held.get(lease.rank, lease.seq + 1):
                held[lease.rank] = lease.seq
        return held

    def count_by_rank(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for lease in self.by_id.values():
            counts[lease.rank] = counts.get(lease.rank, 0) + 1
        return counts

    def world_sizes(self) -> set[int]:
        return {lease.world_size for lease in self.by_id.values()}

    def all(self) -> Iterable[Lease]:
        return list(self.by_id.values())
