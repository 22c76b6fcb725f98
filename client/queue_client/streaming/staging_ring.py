"""A ring of staging slots for batches on their way to a device: host buffers (pinned, for
CUDA) and device buffers made once and reused by every later call, each guarded by a fence.

A call takes the least recently used slot, fills its host buffer, copies it to the slot's
device buffer with one non_blocking copy, works on it there, and records the slot's fence on
the current stream. The slot may be written again only once that fence has passed: until
then the GPU may still be reading it. A slot whose fence has not passed is never waited on
while the ring may grow: a new slot is made in its place in the ring order, up to
`max_slots`, so a trainer that runs a few steps ahead of its GPU never blocks in get_batch.
Only a GPU more than `max_slots` batches behind makes a call wait (`waits` counts those), as
back-pressure. A slot grows, once, when a batch needs more bytes than it holds; its cached
views are dropped then. The allocators and the fence are passed in, so this bookkeeping runs
and is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

# The smallest slot: a few pages, so the first batches of a ramp do not each grow a slot.
MIN_SLOT_BYTES = 4096
# Views cached per slot (one entry per batch layout seen): a ramp through many sizes clears
# them instead of growing without bound.
MAX_CACHED_LAYOUTS = 32


class Fence(Protocol):
    """What guards a slot: torch.cuda.Event has this shape (record on the current stream)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Slot:
    """One staging slot: a flat host buffer, a flat device buffer (None where the ring makes
    none), the fence of the last call that used them, and views of them cached per layout."""

    __slots__ = ("capacity", "device", "fence", "host", "views")

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.capacity = 0
        self.host = torch.empty(0, dtype=torch.uint8)
        self.device: torch.Tensor | None = None
        self.views: dict[Any, Any] = {}


def slot_bytes(nbytes: int) -> int:
    """The capacity a slot is given for `nbytes`: the next power of two (at least
    MIN_SLOT_BYTES), so a batch that grows a little at a time grows a slot rarely."""
    return max(MIN_SLOT_BYTES, 1 << max(0, nbytes - 1).bit_length())


class StagingRing:
    """Slots in least-recently-used order; `acquire` hands out the next one that is free."""

    def __init__(
        self,
        alloc_host: Callable[[int], torch.Tensor],
        alloc_device: Callable[[int], torch.Tensor] | None,
        make_fence: Callable[[], Fence],
        *,
        min_slots: int = 2,
        max_slots: int = 4,
    ) -> None:
        if not 1 <= min_slots <= max_slots:
            raise ValueError(f"need 1 <= min_slots <= max_slots, got {min_slots}, {max_slots}")
        self._alloc_host = alloc_host
        self._alloc_device = alloc_device
        self._make_fence = make_fence
        self.min_slots = min_slots
        self.max_slots = max_slots
        self._slots: list[Slot] = []
        self._next = 0  # the least recently used slot
        self.waits = 0  # calls that had to wait for the GPU to free a slot
        self.last_nbytes = 0  # the bytes the last call staged (what crossed the link)

    @property
    def slots(self) -> tuple[Slot, ...]:
        """The slots in ring order (for tests and diagnostics: writing into them races the
        GPU's reads)."""
        return tuple(self._slots)

    def acquire(self, nbytes: int) -> Slot:
        """A slot holding at least `nbytes` whose last use the GPU has finished with. The
        caller records its fence once it has queued the work that reads the slot."""
        i = self._next
        slots = self._slots
        if len(slots) < self.min_slots:
            slot = self._insert(i)
        else:
            slot = slots[i]
            if not slot.fence.query():  # the GPU still reads it: add a slot, else wait
                if len(slots) < self.max_slots:
                    slot = self._insert(i)
                else:
                    slot.fence.synchronize()
                    self.waits += 1
        self._next = (i + 1) % len(slots)
        if slot.capacity < nbytes:
            self._grow(slot, nbytes)
        self.last_nbytes = nbytes
        return slot

    def _insert(self, i: int) -> Slot:
        """A new slot, placed as the most recently used (just before the oldest)."""
        slot = Slot(self._make_fence())
        self._slots.insert(i, slot)
        return slot

    def _grow(self, slot: Slot, nbytes: int) -> None:
        """Give `slot` buffers for `nbytes` (its old ones are free: its fence has passed)."""
        capacity = slot_bytes(nbytes)
        slot.views.clear()
        slot.host = self._alloc_host(capacity)
        slot.device = None if self._alloc_device is None else self._alloc_device(capacity)
        slot.capacity = capacity


class CudaFence:
    """A CUDA event recorded on the current stream of the ring's device (not of whichever
    device is current: a trainer on cuda:1 may leave cuda:0 current). No timing: recording
    one costs a few microseconds at most."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()


def cuda_ring(device: torch.device) -> StagingRing:
    """The ring of a CUDA transfer: pinned host buffers, device buffers on `device`, and a
    CudaFence per slot."""

    def pinned(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def on_device(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=device)

    return StagingRing(pinned, on_device, lambda: CudaFence(device))
