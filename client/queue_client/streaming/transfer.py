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

CUDA: what a call costs beside the copy is what limits a batch of a few hundred KiB, so a
call does as little as it can: one memcpy per stored tensor into a slot of a ring of pinned
buffers made once (staging_ring.py), all of a batch's stored bytes in one flat buffer so one
`non_blocking` host-to-device copy moves them into the slot's device buffer, then the
widening fused on the device: x and y of a window in one kernel, into new memory
(staging_layout.py). The slot's CUDA event is recorded on the current stream, and nothing in
the call waits for the GPU: the returned tensors are valid on the current stream, as any
tensor torch returns from a non_blocking copy. Only a GPU more batches behind than the ring
has slots makes a call wait for one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from queue_client.format.storage import BatchCodec
from queue_client.streaming.staging_layout import Layout, SlotViews, widen
from queue_client.streaming.staging_ring import MAX_CACHED_LAYOUTS, StagingRing, cuda_ring


class StoredBatch:
    """One batch as a file stores it: per served field the narrow view of its values (None
    for a derived field), the stored tensors' batch slices, and the codec that serves them.
    `fields` may be left to be sliced on first use from a file's per-row field views (rows
    r0..r1): a device transfer reads only the stored tensors."""

    __slots__ = ("_fields", "_rows", "codec", "stored")

    def __init__(
        self,
        codec: BatchCodec,
        fields: list[torch.Tensor | None] | None,
        stored: list[torch.Tensor],
        rows: tuple[Sequence[torch.Tensor | None], int, int] | None = None,
    ) -> None:
        self.codec = codec
        self._fields = fields
        self._rows = rows
        self.stored = stored

    @property
    def fields(self) -> list[torch.Tensor | None]:
        fields = self._fields
        if fields is None:
            assert self._rows is not None, "a StoredBatch needs its fields or their rows"
            row_fields, r0, r1 = self._rows
            fields = self._fields = [None if f is None else f[r0:r1] for f in row_fields]
        return fields


class Transfer:
    """Turns one stored batch into the tensors handed to the trainer (deliver), or writes it
    into the trainer's own (deliver_into). Called with plain views, it hands them on as they
    are (to the device, or copied): the legacy reader's batches.

    `ring`: stage batches through it (a CUDA device makes its own of pinned memory). Given
    with a CPU device, the whole device path runs on the CPU: how the tests check its
    layouts and its fused widening where no GPU is present."""

    def __init__(
        self, device: str | torch.device, copy: bool = False, *, ring: StagingRing | None = None
    ) -> None:
        self.device = torch.device(device)
        self.copy = copy
        if ring is None and self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {self.device} requested but CUDA is not available")
            ring = cuda_ring(self.device)
        self.ring = ring
        self._layouts: dict[tuple[object, ...], Layout] = {}

    @property
    def serves_views(self) -> bool:
        """Batches go to the trainer as zero-copy CPU views (the stream hands them out)."""
        return self.ring is None and not self.copy

    def deliver(self, batch: StoredBatch) -> list[torch.Tensor]:
        """The served fields of a stored batch: on the device, or widened into fresh memory."""
        if self.ring is None:
            return batch.codec.serve(batch.fields, batch.stored, copy=self.copy)
        return self._staged(batch.codec, batch.stored, None)

    def deliver_into(self, batch: StoredBatch, outs: Sequence[torch.Tensor]) -> None:
        """Write a stored batch's served fields into the caller's tensors: on CPU one widening
        copy_ per field; on a device the narrow bytes cross the link and are widened there."""
        if self.ring is None:
            batch.codec.serve_into(batch.fields, batch.stored, outs)
            return
        self._staged(batch.codec, batch.stored, outs)

    @property
    def staging(self) -> tuple[torch.Tensor, ...]:
        """The flat host buffer of each staging slot (pinned for CUDA; empty without a ring).
        A view for tests and diagnostics: writing into them would race the GPU's reads."""
        return () if self.ring is None else tuple(s.host for s in self.ring.slots)

    def __call__(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of tensors stored as served, on their way to the trainer."""
        if self.ring is not None:
            return self._staged(None, views, None)
        if self.copy:
            return [torch.empty(v.shape, dtype=v.dtype).copy_(v) for v in views]
        return list(views)

    def _staged(
        self,
        codec: BatchCodec | None,
        stored: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        """Stage, copy and serve one batch through the ring; `outs` written if given."""
        if codec is None:
            key: tuple[object, ...] = (None, *[(t.shape, t.dtype) for t in stored])
        else:
            key = (codec, *[t.shape for t in stored])
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, codec, stored)
        ring = self.ring
        assert ring is not None
        slot = ring.acquire(layout.nbytes)
        views: SlotViews | None = slot.views.get(key)
        if views is None:
            if len(slot.views) >= MAX_CACHED_LAYOUTS:
                slot.views.clear()
            views = slot.views[key] = layout.views(slot)
        views.fill(stored)
        views.device.copy_(views.host_span, non_blocking=True)
        groups = views.groups
        served: list[torch.Tensor] = []
        if outs is None:
            if groups is not None:
                served = widen(groups)
            else:
                assert codec is not None  # plain batches always fuse
                served = codec.serve(views.fields, views.parts, copy=True)
        elif groups is not None:
            for out, field in zip(outs, views.fields, strict=True):
                out.copy_(field, non_blocking=True)  # type: ignore[arg-type]  # all direct
        else:
            assert codec is not None
            codec.serve_into(views.fields, views.parts, outs)
        slot.fence.record()
        return served

    def _layout(
        self, key: tuple[object, ...], codec: BatchCodec | None, stored: Sequence[torch.Tensor]
    ) -> Layout:
        if len(self._layouts) >= MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        layout = self._layouts[key] = Layout(codec, stored)
        return layout
