"""Which seq each rank reads next, and how far ahead production may run: pure arithmetic.

Deterministic mode: rank r of world size W reads seqs r, r+W, r+2W, ... (queue_client.World
names that rule). A rank's window runs from its frontier (the lowest seq it holds, or the
next one it will ask for) over `max_backlog_files + 2` of its seqs: the file it reads, the
prefetched one, and the backlog ready ahead. Production makes a seq only inside its rank's
window, so the files on disk are bounded by the windows.

Best-effort mode: any rank takes the lowest ready file, unless it is `max_lead` files ahead
of the slowest rank.

Elastic: a request at a new world size re-partitions the seqs (ranks and windows are reckoned
anew), refused while ranks of another world size hold leases.

Node-local (`served`, from server.ranks): a server of some ranks of a fixed world size refuses
other ranks and other world sizes (NotServed), and only its ranks' windows count.

No I/O and no asyncio here: SplitQueue feeds it facts (the lowest leased seq per rank) and
asks questions, so every rule is testable on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from queue_client import errors
from queue_client.world import World
from queue_server.config.served_ranks import MAX_WORLD_SIZE, ServedRanks

DETERMINISTIC, BEST_EFFORT = "deterministic", "best_effort"
# Past this many ranks only the ranks seen so far are scanned, not every rank.
_SCAN_ALL_RANKS_UP_TO = 1024


@dataclass
class Schedule:
    mode: str
    max_backlog_files: int
    max_lead: int = 0
    world_size: int = 1
    # rank -> the latest seq it asked for (moved back only by a rewind).
    last_acquired: dict[int, int] = field(default_factory=dict)
    # rank -> the highest seq it consumed under world_size.
    last_consumed: dict[int, int] = field(default_factory=dict)
    # rank -> files consumed (best-effort lead accounting).
    consumed_by_rank: dict[int, int] = field(default_factory=dict)
    # The ranks this server serves (server.ranks); all of them by default.
    served: ServedRanks = field(default_factory=ServedRanks)

    def __post_init__(self) -> None:
        self._served_sorted = sorted(self.served.ranks) if self.served.ranks is not None else []

    @property
    def deterministic(self) -> bool:
        return self.mode == DETERMINISTIC

    @property
    def files_per_window(self) -> int:
        """Seqs of one rank that may be on disk at once: reading, prefetched, backlog."""
        return self.max_backlog_files + 2

    # ---- requests -----------------------------------------------------------------------
    def check(self, rank: int, world_size: int, seq: int | None, carried: bool) -> World:
        """Validate a lease request; returns the requesting rank's World."""
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise errors.InvalidRequest(f"world_size {world_size} is outside [1, {MAX_WORLD_SIZE}]")
        if not 0 <= rank < world_size:
            raise errors.InvalidRequest(f"rank {rank} is outside [0, world_size={world_size})")
        self._check_served(rank, world_size)
        world = World(rank, world_size)
        if seq is not None:
            if seq < 0:
                raise errors.InvalidRequest(f"seq {seq} is negative")
            if self.deterministic and not carried and not world.owns(seq):
                owner = World.owner_of(seq, world_size)
                raise errors.InvalidRequest(
                    f"seq {seq} belongs to rank {owner.rank} of world_size {world_size}, not to rank {rank}"
                )
        return world

    def _check_served(self, rank: int, world_size: int) -> None:
        served = self.served
        if served.all:
            return
        if world_size != served.world_size:
            raise errors.NotServed(
                f"world_size {world_size} is not the world this server serves: it serves "
                f"{served.describe()}; start the servers with world_size = {world_size} (and "
                "each node's ranks of it) to train at that size"
            )
        if not served.serves(rank):
            raise errors.NotServed(
                f"rank {rank} of world_size {world_size} is not served here: this server serves "
                f"{served.describe()}; connect rank {rank} to the server of its own node"
            )

    def adopt(self, world_size: int, live_world_sizes: set[int], where: str) -> None:
        """Take a request's world size; an elastic change re-partitions every rank's stream."""
        if world_size == self.world_size:
            return
        if live_world_sizes and live_world_sizes != {world_size}:
            raise errors.LeaseConflict(
                f"world_size {world_size} conflicts with the live leases of {where}, held at "
                f"world_size {sorted(live_world_sizes)}; stop those ranks or wait for their "
                "leases to expire"
            )
        self.world_size = world_size
        self.last_acquired.clear()
        self.last_consumed.clear()

    def note_request(self, rank: int, seq: int, pin: bool) -> None:
        """A rank asked for its own seq: move its position forward, or back on a rewind.

        With `pin` (a lease taken back after a server restart, or a composer's hold) the
        position moves only forward: fetching an old file again is not a rewind."""
        if not World(rank, self.world_size).owns(seq):
            return
        prev = self.last_acquired.get(rank)
        if prev is None or seq > prev or (seq < prev - self.world_size and not pin):
            self.last_acquired[rank] = seq

    def note_consumed(self, rank: int, seq: int) -> None:
        self.last_consumed[rank] = max(seq, self.last_consumed.get(rank, -1))
        self.consumed_by_rank[rank] = self.consumed_by_rank.get(rank, 0) + 1

    # ---- positions ----------------------------------------------------------------------
    def next_for(self, rank: int) -> int:
        """The seq this rank asks for next when it names none."""
        last = self.last_acquired.get(rank)
        if last is None:
            last = self.last_consumed.get(rank)
        return rank if last is None else last + self.world_size

    def _position(self, rank: int) -> int:
        """Where production takes a rank to be: its next seq, or for a rank not heard from
        yet, where the slowest rank heard from is. Ranks advance together, and a server that
        a resumed job reaches rank by rank (a fresh one on an empty root) must not make, and
        wait on, a silent rank's first seqs; if it does ask for one, it is made on demand."""
        if rank in self.last_acquired or rank in self.last_consumed:
            return self.next_for(rank)
        known = list(self.last_acquired.values()) or list(self.last_consumed.values())
        return rank + self.world_size * (min(known) // self.world_size) if known else rank

    def frontier(self, rank: int, held: Mapping[int, int]) -> int:
        """The lowest seq this rank still needs: the file it holds, or its next one.
        `held` maps a rank to the lowest seq it holds a lease on."""
        low = held.get(rank)
        return low if low is not None else self._position(rank)

    def first_unread(self, rank: int, held: Mapping[int, int]) -> int:
        """The lowest seq of its own this rank may still read: one it holds or asked for
        last (and may be waiting for), else its next. Seqs below it were read already."""
        asked = [s for s in (held.get(rank), self.last_acquired.get(rank)) if s is not None]
        return min(asked) if asked else self._position(rank)

    def window_end(self, rank: int, held: Mapping[int, int]) -> int:
        """The first seq past this rank's window."""
        return self.frontier(rank, held) + self.world_size * self.files_per_window

    def window_shut(
        self,
        rank: int,
        seq: int,
        held_seqs: list[int],
        held: Mapping[int, int] | None = None,
        next_forward: Sequence[int] = (),
    ) -> str:
        """Why `seq` is not made, when a window holds it back; "" otherwise. Either the rank's
        own unreleased leases (`held_seqs`) hold its window shut, or production, which makes
        each slot's seqs in order (`next_forward`: each slot's next; seq's slot is seq mod
        their count), is stuck before seq at a seq of another rank, out of that rank's window
        (`held`: the lowest seq each rank holds)."""
        if held_seqs and seq >= self.window_end(rank, {rank: min(held_seqs)}):
            return self._own_leases_shut(rank, seq, held_seqs)
        if held is None or not next_forward:
            return ""
        made_next = next_forward[seq % len(next_forward)]
        if made_next >= seq or self.in_window(made_next, held):
            return ""
        return self._other_rank_shut(rank, seq, held, made_next)

    def _other_rank_shut(self, rank: int, seq: int, held: Mapping[int, int], made_next: int) -> str:
        """One rank read far ahead of another: its next file waits behind the other's."""
        other = World.owner_of(made_next, self.world_size).rank
        first = self.first_unread(other, held)
        unread = range(first, self.window_end(other, held), self.world_size)
        shown = ", ".join(map(str, unread[:8])) + (", ..." if len(unread) > 8 else "")
        return (
            f": files are made in seq order, and seq {made_next} of rank {other} comes first; "
            f"rank {other} has not read its seqs {shown} (at most {self.files_per_window} of a "
            f"rank's seqs, max_backlog_files {self.max_backlog_files} + 2, are made ahead of "
            f"what it has read), so rank {rank}'s seq {seq} waits until rank {other} reads "
            f"seq {first}: ranks must advance together (read the ranks' streams side by "
            "side, not one rank far ahead of another; see docs/ordering.md)"
        )

    def _own_leases_shut(self, rank: int, seq: int, held_seqs: list[int]) -> str:
        seqs = sorted(held_seqs)
        shown = ", ".join(map(str, seqs[:8])) + (", ..." if len(seqs) > 8 else "")
        return (
            f": rank {rank} holds {len(seqs)} unreleased lease(s) (seqs {shown}), and a rank's "
            f"files are made only within {self.files_per_window} of its seqs "
            f"(max_backlog_files {self.max_backlog_files} + 2) from the lowest one it holds, so seq {seq} "
            f"waits until seq {seqs[0]} is released: release the leases it has read "
            "(ReleaseLease CONSUMED, or RETURNED) before asking for more"
        )

    def in_window(self, seq: int, held: Mapping[int, int]) -> bool:
        """Deterministic mode: whether seq may be on disk now."""
        return seq < self.window_end(World.owner_of(seq, self.world_size).rank, held)

    def best_effort_room(self, unleased_files: int, in_production: int) -> bool:
        """Best-effort mode: whether one more file may be made now."""
        return unleased_files + in_production < self.max_backlog_files * self.world_size

    def may_take(self, rank: int) -> bool:
        """Best-effort mode: whether this rank is less than max_lead files ahead of the slowest."""
        mine = self.consumed_by_rank.setdefault(rank, 0)
        slowest = min(self.consumed_by_rank.get(r, 0) for r in range(self.world_size))
        return mine - slowest < self.max_lead

    def serves_seq(self, seq: int) -> bool:
        """Whether seq belongs to a rank this server serves."""
        return self.served.serves(seq % self.world_size)

    def next_served_seq(self, start: int, slot: int, slots: int) -> int | None:
        """The first seq at or after `start` that slot `slot` of `slots` makes (seq = slot mod
        slots) and whose rank is served here; None if that slot makes none of them."""
        first = start + (slot - start) % slots
        if self.served.all:
            return first
        w = self.world_size
        common = math.gcd(w, slots)
        best: int | None = None
        for rank in self._served_sorted:
            if (rank - slot) % common:
                continue  # seq = rank (mod w) and seq = slot (mod slots) never meet
            seq = start + (rank - start) % w
            while seq % slots != slot:  # at most slots / common steps
                seq += w
            if best is None or seq < best:
                best = seq
        return best

    def active_ranks(self, held: Mapping[int, int]) -> range | list[int]:
        """Ranks whose windows matter: the ranks served here, all of them for small worlds,
        else those seen."""
        if not self.served.all:
            return self._served_sorted
        if self.world_size <= _SCAN_ALL_RANKS_UP_TO:
            return range(self.world_size)
        seen = set(self.last_acquired) | set(held)
        return sorted(seen) or [0]

    def lowest_unread(self, held: Mapping[int, int]) -> int:
        """The lowest seq any active rank may still read: every rank is past the seqs below.
        A seq a rank asked for and still waits on counts (its frontier is past it)."""
        return min(self.first_unread(r, held) for r in self.active_ranks(held))

    def ahead_of_requests(self, held: Mapping[int, int]) -> Iterator[range]:
        """Per rank that asked: its seqs after its latest request, to the end of its window.
        A rank that rewound to a checkpoint needs these made again ahead of demand; the seqs
        before its latest request were read already and must not come back unasked."""
        for rank, asked in self.last_acquired.items():
            yield range(asked + self.world_size, self.window_end(rank, held), self.world_size)

    def change_point(self, position: int, earliest: int) -> int:
        """The first seq a setting change may apply to, given the caller's position: a round
        of W files past anything that may be composed already, so the same calls at the same
        steps give the same batches whatever the timing."""
        w = self.world_size
        return max(earliest, w * (position // w + self.files_per_window + 1))
