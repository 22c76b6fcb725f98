"""Moving a batch from the mapped file to where the trainer wants it, in the dtypes the schema
promises.

A batch arrives as a `StoredBatch`: its views of what the file stores (narrow token ids, one
window for x and y, no derivable masks) and the codec that serves the fields from them
(storage.py).

CPU: by default the batch is a set of views (zero-copy; the map stays alive as long as any
view does, even after the file is deleted) where the file stores the served dtypes, else its
rows widened into memory of their own per call; the stream hands those out itself
(`serves_views`, rows.py). With `copy=True` each field is
widened into freshly allocated memory, one copy per field: a reused output buffer would be
unsafe, because autograd keeps the previous batch's input ids alive (embedding backward reads
them) with no Python reference that would tell us so. `out=` buffers (deliver_into) get one
widening `copy_` per field, straight from the narrow views.

CUDA: one memcpy of the stored tensors into a pinned staging buffer, one `non_blocking`
host-to-device copy of those narrow bytes, and the widening (and any derived field) on the
device. Two staging slots alternate; an event recorded after each copy guards a slot's
reuse, so the CPU never overwrites memory the GPU is still reading.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from queue_client.storage import BatchCodec


class StoredBatch:
    """One batch as a file stores it: per served field the narrow view of its values (None
    for a derived field), the stored tensors' batch slices, and the codec that serves them."""

    __slots__ = ("codec", "fields", "stored")

    def __init__(
        self,
        codec: BatchCodec,
        fields: list[torch.Tensor | None],
        stored: list[torch.Tensor],
    ) -> None:
        self.codec = codec
        self.fields = fields
        self.stored = stored


class Transfer:
    """Turns one stored batch into the tensors handed to the trainer (deliver), or writes it
    into the trainer's own (deliver_into). Called with plain views, it hands them on as they
    are (to the device, or copied): the legacy reader's batches."""

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
    def serves_views(self) -> bool:
        """Batches go to the trainer as zero-copy CPU views (the stream hands them out)."""
        return not self._is_cuda and not self.copy

    def deliver(self, batch: StoredBatch) -> list[torch.Tensor]:
        """The served fields of a stored batch: on the device, or widened into fresh memory."""
        codec = batch.codec
        if self._is_cuda:
            dev = [buf.to(self.device, non_blocking=True) for buf in self._stage(batch.stored)]
            self._record()
            if codec.identity:
                return dev
            return codec.serve(codec.field_views(dev), dev)
        return codec.serve(batch.fields, batch.stored, copy=self.copy)

    def deliver_into(self, batch: StoredBatch, outs: Sequence[torch.Tensor]) -> None:
        """Write a stored batch's served fields into the caller's tensors: on CPU one widening
        copy_ per field; on CUDA the narrow bytes cross the link and are widened there."""
        codec = batch.codec
        if not self._is_cuda:
            codec.serve_into(batch.fields, batch.stored, outs)
            return
        staged = self._stage(batch.stored)
        if codec.identity:
            for out, buf in zip(outs, staged, strict=True):
                out.copy_(buf, non_blocking=True)
            self._record()
            return
        dev = [buf.to(self.device, non_blocking=True) for buf in staged]
        self._record()
        codec.serve_into(codec.field_views(dev), dev, outs)

    @property
    def staging(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The flat pinned buffers of each staging slot, one per stored field (CUDA only; a
        slot is empty before its first batch). A view for tests and diagnostics: writing
        into them would race the GPU's reads."""
        return tuple(tuple(slot) for slot in self._staging)

    def __call__(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of tensors stored as served, on their way to the trainer."""
        if self._is_cuda:
            return self._to_cuda(views)
        if self.copy:
            return [torch.empty(v.shape, dtype=v.dtype).copy_(v) for v in views]
        return list(views)

    def _stage(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy `views` into this slot's pinned buffers. A slot keeps one flat buffer per
        field and reuses it for any batch it can hold, so batch sizes that change (a ramp,
        the two pieces of a batch that crosses files) allocate no pinned memory again."""
        slot = self._slot
        flat = self._staging[slot]
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the GPU has finished reading this slot's last batch
        if len(flat) != len(views):
            flat = [torch.empty(0, dtype=v.dtype) for v in views]
        if any(
            f.dtype != v.dtype or f.numel() < v.numel() for f, v in zip(flat, views, strict=True)
        ):
            flat = [
                f if f.dtype == v.dtype and f.numel() >= v.numel()
                else torch.empty(max(v.numel(), f.numel()), dtype=v.dtype, pin_memory=True)
                for f, v in zip(flat, views, strict=True)
            ]  # fmt: skip
            self._staging[slot] = flat
        staged = [f[: v.numel()].view(v.shape) for f, v in zip(flat, views, strict=True)]
        for buf, v in zip(staged, views, strict=True):
            buf.copy_(v)
        return staged

    def _record(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events[self._slot] = event
        self._slot = 1 - self._slot

    def _to_cuda(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = [buf.to(self.device, non_blocking=True) for buf in self._stage(views)]
        self._record()
        return out
