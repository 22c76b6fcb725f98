"""Moving a batch from the mapped file to where the trainer wants it.

CPU: the batch is a view into the memory-mapped file (zero-copy; the map stays alive as long
as any view does, even after the file is deleted). With `copy=True` each field is copied into
freshly allocated memory: a reused output buffer would be unsafe, because autograd keeps the
previous batch's input ids alive (embedding backward reads them) with no Python reference
that would tell us so.

CUDA: one memcpy into a pinned staging buffer, then one `non_blocking` host-to-device copy.
Two staging slots alternate; an event recorded after each copy guards a slot's reuse, so the
CPU never overwrites memory the GPU is still reading.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Transfer:
    """Callable that turns views of one batch into the tensors handed to the trainer."""

    def __init__(self, device: str | torch.device, copy: bool = False) -> None:
        self.device = torch.device(device)
        self.copy = copy
        self._is_cuda = self.device.type == "cuda"
        if self._is_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")
        self._staging: list[list[torch.Tensor]] = [[], []]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0

    @property
    def staging(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The pinned buffers of each staging slot (CUDA only; a slot is empty before its
        first batch). A view for tests and diagnostics: writing into them would race the
        GPU's reads."""
        return tuple(tuple(slot) for slot in self._staging)

    def __call__(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._is_cuda:
            return self._to_cuda(views)
        if self.copy:
            return [torch.empty(v.shape, dtype=v.dtype).copy_(v) for v in views]
        return list(views)

    def into(self, views: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Copy a batch into the caller's own tensors (on CPU, or on the device via staging)."""
        if self._is_cuda:
            for out, staged in zip(outs, self._stage(views), strict=True):
                out.copy_(staged, non_blocking=True)
            self._record()
            return
        for out, v in zip(outs, views, strict=True):
            out.copy_(v)

    def _stage(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        slot = self._slot
        staging = self._staging[slot]
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the GPU has finished reading this slot's last batch
        if len(staging) != len(views) or any(
            s.shape != v.shape or s.dtype != v.dtype for s, v in zip(staging, views, strict=True)
        ):
            staging = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in views]
            self._staging[slot] = staging
        for buf, v in zip(staging, views, strict=True):
            buf.copy_(v)
        return staging

    def _record(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events[self._slot] = event
        self._slot = 1 - self._slot

    def _to_cuda(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = [buf.to(self.device, non_blocking=True) for buf in self._stage(views)]
        self._record()
        return out
