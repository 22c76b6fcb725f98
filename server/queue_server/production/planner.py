"""Which seq each production slot makes next, and whether it writes a file: the bookkeeping of
one split's production, with no I/O and no asyncio, so every rule is testable on its own.

Slot s of N makes seqs s, s+N, ... in order ("forward"), and any seq again on demand
("reproduce": after a resume rewind, a quarantine, a lost file). A seq is made only inside its
rank's window (schedule.py), so the files on disk stay bounded.

Node-local serving (server.ranks): forward production makes only the seqs of the ranks served
here. A stateless provider skips the others, since a file is a pure function of its seq. A
streaming provider must still pass its stream through them, or the next file it makes would
differ from the one-server run: it advances past them (makes the batches and drops them; the
states are journaled), and the same for seqs its ranks have read already. A seq a client asks
for explicitly (a carried file after an elastic resume, which may be any rank's) is made
whatever its rank: at once when stateless, when the forward stream reaches it otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from queue_server.split.schedule import Schedule
from queue_server.split.state import SplitState


@dataclass(frozen=True)
class Job:
    """Make `seq`. again: not the forward stream's next (made from its journaled state, or
    afresh for a stateless provider). publish False: advance the forward stream past seq,
    writing nothing."""

    seq: int
    again: bool = False
    publish: bool = True


class Planner:
    """The next job of each slot. can_advance False keeps every seq of the forward stream a
    published file (no backend needs it since a curriculum composer passes over seqs, as a
    streaming provider does, for curriculum_streams on node-local servers)."""

    def __init__(
        self, slots: int, schedule: Schedule, state: SplitState, *, can_advance: bool = True
    ) -> None:
        self.slots = slots
        self.schedule = schedule
        self.state = state
        self.can_advance = can_advance
        self.stateful = False  # the provider streams (set when its slots start)
        self.next_forward = list(range(slots))
        self.reproduce: set[int] = set()
        # Streaming: seqs asked for ahead of the forward stream, published when it gets there.
        self.wanted: set[int] = set()
        self.in_production: set[int] = set()

    def resume(self, last_forward: Mapping[int, tuple[int, int]]) -> None:
        """Carry each slot's forward stream on after the last seq it journaled."""
        for slot, (seq, _offset) in last_forward.items():
            if slot < self.slots:
                self.next_forward[slot] = seq + self.slots

    # ---- what is asked for ----------------------------------------------------------------
    def want(self, seq: int, explicit: bool = False) -> None:
        """Make sure seq will be on disk. A rank's own seq is reached by forward production
        inside the rank's window, or made again; an `explicit` one (a carried file) is made
        whatever its rank and window."""
        if seq in self.state.files or seq in self.in_production:
            return
        if seq < self.next_forward[seq % self.slots]:
            self.reproduce.add(seq)
        elif explicit and not self.stateful:
            self.reproduce.add(seq)  # a pure function of its seq: make it now
        elif explicit and self.can_advance:
            self.wanted.add(seq)

    def make_again(self, seq: int) -> None:
        """A quarantined seq: make it again from its journaled state."""
        self.reproduce.add(seq)

    # ---- the next job ---------------------------------------------------------------------
    def next_job(self, slot: int, held: Mapping[int, int], unleased_files: int) -> Job | None:
        """This slot's next job, or None while nothing is due. `held` maps a rank to the
        lowest seq it holds a lease on; unleased_files counts ready files (best effort)."""
        mine = sorted(s for s in self.reproduce if s % self.slots == slot)
        if mine:
            self.reproduce.discard(mine[0])
            return Job(mine[0], again=True)
        schedule = self.schedule
        if not schedule.deterministic:
            if not schedule.best_effort_room(unleased_files, len(self.in_production)):
                return None
            return Job(self.next_forward[slot])
        missing = self._missing_in_windows(slot, held)
        if missing is not None:
            return Job(missing, again=True)
        if self.stateful:
            return self._next_streaming(slot, held)
        return self._next_stateless(slot, held)

    def _next_stateless(self, slot: int, held: Mapping[int, int]) -> Job | None:
        schedule = self.schedule
        # Every rank is past the seqs below the lowest unread one: jump over them at once (a
        # rank may ask for a seq far ahead; skipping one by one would stall the loop). A
        # stateless provider can make a skipped seq later if asked. The seq a rank waits for
        # is not read: it is made first, not after the ones behind it in its window.
        floor = schedule.lowest_unread(held)
        if self.next_forward[slot] < floor:
            self.next_forward[slot] = floor + (slot - floor) % self.slots
        while True:
            seq = schedule.next_served_seq(self.next_forward[slot], slot, self.slots)
            if seq is None:
                return None  # this slot makes no seq of the ranks served here
            self.next_forward[slot] = seq
            if not schedule.in_window(seq, held):
                return None
            owner = seq % schedule.world_size
            if seq < schedule.first_unread(owner, held) or seq in self.state.offsets:
                self.next_forward[slot] += self.slots  # read already, or made on demand
                continue
            return Job(seq)

    def _next_streaming(self, slot: int, held: Mapping[int, int]) -> Job | None:
        """The forward stream visits every seq of the slot: published, advanced or waited on."""
        schedule = self.schedule
        seq = self.next_forward[slot]
        if seq in self.wanted:
            return Job(seq)
        if schedule.serves_seq(seq):
            read_already = seq < schedule.first_unread(seq % schedule.world_size, held)
            if self.can_advance and read_already:
                return Job(seq, publish=False)
            if schedule.in_window(seq, held):
                return Job(seq)
            # Out of its window: wait for its rank, unless an asked-for seq lies beyond (it
            # is made again from the journal when its rank gets to it).
            return Job(seq, publish=False) if self._wanted_beyond(seq, slot) else None
        # Another node's seq: pass it only as far as this node needs the stream.
        if self._wanted_beyond(seq, slot):
            return Job(seq, publish=False)
        ahead = schedule.next_served_seq(seq, slot, self.slots)
        if ahead is not None and schedule.in_window(ahead, held):
            return Job(seq, publish=False)
        return None

    def _wanted_beyond(self, seq: int, slot: int) -> bool:
        return any(w > seq and w % self.slots == slot for w in self.wanted)

    def _missing_in_windows(self, slot: int, held: Mapping[int, int]) -> int | None:
        """A seq of this slot inside a rank's window that was made (or advanced) before but
        is not on disk (the rank rewound to a checkpoint): make it again ahead of demand."""
        for ahead in self.schedule.ahead_of_requests(held):
            for seq in ahead:
                if seq >= self.next_forward[seq % self.slots]:
                    break
                if (
                    seq % self.slots == slot
                    and seq not in self.state.files
                    and seq not in self.in_production
                ):
                    return seq
        return None

    # ---- bookkeeping of a job ---------------------------------------------------------------
    def put_back(self, job: Job) -> None:
        """A job not started (held back by the control plane): due again at the next kick.
        A forward job is found again where it was; one made again goes back in its set."""
        if job.again:
            self.reproduce.add(job.seq)

    def started(self, job: Job) -> None:
        self.in_production.add(job.seq)

    def finished(self, job: Job, slot: int, journaled: bool) -> None:
        """A job ended. Journaled: its seq is made (or passed); else it is due again."""
        self.in_production.discard(job.seq)
        if not journaled:
            if job.again:
                self.reproduce.add(job.seq)
            return
        if not job.again:
            self.next_forward[slot] = max(self.next_forward[slot], job.seq + self.slots)
        if job.publish:
            self.wanted.discard(job.seq)

    def first_unmade(self) -> int:
        """The first seq past every seq made or being made by any slot."""
        return max(
            nxt + self.slots if nxt in self.in_production else nxt for nxt in self.next_forward
        )

    def next_seq(self) -> int:
        return min(self.next_forward)
