"""How many files a split's stream keeps leased and loaded ahead of the one being read.

A file switch waits for nothing only if the next file was fetched (leased, verified, mapped,
paged in) before the trainer finished the current one. A trainer that reads a file in R
seconds while a fetch takes L seconds from its start needs about L / R files in flight;
with fewer, it catches up with the fetches and waits at a switch, however many files the
server has ready. So the depth starts at the client's `prefetch_files` and grows, up to
`cap`, as soon as a file is read faster than the files ahead of it are fetched: judged at
every switch, before the stream runs dry, not after a stall.

The depth never shrinks: a trainer that was fast once (a burst after an evaluation, an
epoch of cheap steps) will be again, and what a deeper read-ahead costs is bounded by the
cap: that many leases and mapped files (page cache the server's files share) per split.
"""

from __future__ import annotations

import math

# Weight of the newest fetch in the running estimate of a fetch's duration.
_FETCH_WEIGHT = 0.5


class ReadAhead:
    """A stream's read-ahead depth, between `floor` and `cap` files; see the module."""

    def __init__(self, floor: int, cap: int) -> None:
        if not 0 <= floor <= cap:
            raise ValueError(f"read-ahead floor {floor} must be in [0, cap={cap}]")
        self.floor = floor
        self.cap = cap
        self.depth = floor
        self.fetch_s = 0.0  # running estimate of one fetch, from its start to its end

    def fetched(self, seconds: float) -> None:
        """A fetch took `seconds` from its start to its end (queueing included)."""
        if self.fetch_s == 0.0:
            self.fetch_s = seconds
        else:
            self.fetch_s += _FETCH_WEIGHT * (seconds - self.fetch_s)

    def read(self, seconds: float) -> int:
        """A file was read in `seconds` (its first call to the call that needed the next
        file): deepen if the files ahead cannot keep up at that pace. Returns the depth."""
        if self.depth >= self.cap or self.fetch_s <= 0.0:
            return self.depth
        # One file is read while the next `depth` are fetched in parallel; one more keeps a
        # margin for a fetch slower than the estimate.
        wanted = math.ceil(self.fetch_s / max(seconds, 1e-6)) + 1
        self.depth = min(self.cap, max(self.depth, wanted))
        return self.depth


# How deep a fast trainer's read-ahead may grow, in multiples of prefetch_files: deep enough
# that fetches which start late (the background threads never preempt the trainer's thread,
# lane.py) still end before their file is needed, on a machine whose cores the trainer, the
# server and its workers share. Files read ahead from the data root are mapped page cache;
# streamed ones (transport "grpc") are the client's own memory, so they go less deep.
CAP_FACTOR = 4
CAP_FACTOR_IN_MEMORY = 2


def read_ahead_for(
    prefetch_files: int, allowed: int | None = None, *, in_memory: bool = False
) -> ReadAhead:
    """The read-ahead of a stream of a client with `prefetch_files` (0: prefetch off): at
    least that many files, at most CAP_FACTOR times as many (CAP_FACTOR_IN_MEMORY for files
    held `in_memory`; and 16), and no more than the server lets the rank hold ahead
    (`allowed`, None: unbounded), so no lease waits on the trainer's next release: a paused
    trainer never finds one timed out."""
    factor = CAP_FACTOR_IN_MEMORY if in_memory else CAP_FACTOR
    cap = min(16, factor * prefetch_files)
    if allowed is not None:
        cap = min(cap, allowed)
    return ReadAhead(prefetch_files, max(prefetch_files, cap))
