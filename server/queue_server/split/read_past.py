"""Files a rank read past: consumed, though the journal never heard of their release.

In deterministic mode rank r of W reads its seqs r, r+W, r+2W, ... in order, and releases
each file once it has read it. A release the journal had no room for is kept in memory and
journaled once it has (removal.py); but a server killed or restarted meanwhile forgets it,
and the file is on disk at the next start as if unread, below where the trainer reads on: no
one asks for it again, and it would stay on disk for good. So, for the files on disk when the
split opened and not leased since: once the journal records that r consumed seq c, each of
r's such files below c and below the seq r reads next (Schedule.first_unread) was read by r
before the restart.

A rank that rewinds to a checkpoint asks for its older seqs again, which moves its first
unread seq back: what it will read again is never taken for read past. A rank that has not
asked since the restart is reckoned at the seq after its last consumed one, so a file is
found only below a consumption the journal holds, never by guessing where a trainer will
resume. A file taken for read past is journaled as consumed and deleted (removal.py); a rank
that asks for it after all (a client that reads its seqs out of order) has it made again, as
any consumed seq is, so nothing unread is lost. Once the world size differs from the
journal's at the start (an elastic resume gives the files carried over to new ranks by their
order, not by seq mod W), nothing is taken for read past until the next start.

Pure arithmetic on the split's facts, like schedule.py: which seqs, not what to do with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from queue_server.split.schedule import Schedule


def read_past(schedule: Schedule, free: Iterable[int], held: Mapping[int, int]) -> list[int]:
    """Of the `free` files (on disk, leased to nobody), those their rank read past,
    ascending. `held` maps each rank to the lowest seq it holds a lease on."""
    if not schedule.deterministic:
        return []
    w = schedule.world_size
    found = []
    for seq in free:
        rank = seq % w
        last = schedule.last_consumed.get(rank)
        # A seq carried over from another rank (an elastic resume) says nothing of r's own.
        if last is None or last % w != rank or seq >= last:
            continue
        if seq < schedule.first_unread(rank, held):
            found.append(seq)
    return sorted(found)
