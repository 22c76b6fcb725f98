"""Where one batch's stored tensors sit in a staging slot, and how its served fields are made
from them on the device with as few kernels as possible.

A layout packs the stored tensors of a batch (narrow token ids, per-row extras) one after the
other into one flat byte buffer, each at a 64-byte boundary, so a whole batch crosses the link
in one copy. Widening is fused: served fields that are the same kind of view of the stored
bytes at evenly spaced offsets (x and y of a token window: the same [B, T] view, one token
apart) become one strided view over all of them, widened by one kernel into one contiguous
[k, B, T] tensor whose rows are the fields. So x and y cost one kernel, not two, and each is
contiguous memory of its own kind, newly allocated per call: the trainer may keep a batch as
long as it likes (autograd keeps input ids alive) while the slot is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from queue_client.format.schema import torch_dtype
from queue_client.format.storage import BatchCodec
from queue_client.streaming.staging_ring import Slot

ALIGN = 64


@dataclass(frozen=True)
class Part:
    """One stored tensor's place in the flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


class Layout:
    """The parts of one batch shape of one codec (None: tensors served as they are stored)."""

    __slots__ = ("codec", "nbytes", "parts")

    def __init__(self, codec: BatchCodec | None, stored: Sequence[torch.Tensor]) -> None:
        self.codec = codec
        parts = []
        at = 0
        for t in stored:
            nbytes = t.numel() * t.element_size()
            parts.append(Part(at, nbytes, t.dtype, t.shape))
            at += -(-nbytes // ALIGN) * ALIGN
        self.parts = tuple(parts)
        self.nbytes = at

    def views(self, slot: Slot) -> SlotViews:
        """This layout's views of `slot`'s buffers (made once per slot, then cached there)."""
        return SlotViews(self, slot)


def _typed(flat: torch.Tensor, part: Part) -> torch.Tensor:
    return flat[part.offset : part.offset + part.nbytes].view(part.dtype).view(part.shape)


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host tensor, or None for a dtype numpy lacks (bfloat16)."""
    try:
        return t.numpy()
    except TypeError:
        return None


class SlotViews:
    """One layout's views of one slot: per part the host memory to fill (numpy where it can:
    torch's copy_ of uint16 has no fast path, about three times its int16 copy), the
    flat host and device spans of one copy, and the device-side plan that serves the fields."""

    __slots__ = ("device", "fields", "groups", "host", "host_np", "host_span", "parts", "served")

    def __init__(self, layout: Layout, slot: Slot) -> None:
        assert slot.device is not None, "a device layout needs a slot with a device buffer"
        n = layout.nbytes
        self.host = [_typed(slot.host, p) for p in layout.parts]
        self.host_np = [_numpy(h) for h in self.host]
        self.host_span = slot.host[:n]
        self.device = slot.device[:n]
        self.parts = [_typed(slot.device, p) for p in layout.parts]
        codec = layout.codec
        if codec is None:  # served as stored
            self.fields: list[torch.Tensor | None] = list(self.parts)
            self.served = [p.dtype for p in layout.parts]
        else:
            self.fields = codec.field_views(self.parts)
            self.served = [torch_dtype(f.dtype) for f in codec.schema]
        direct = codec is None or codec.copies_only
        # (source view, served dtype, fields it holds) per fused group; None: the codec's path.
        self.groups = fuse(self.fields, self.served) if direct else None  # type: ignore[arg-type]

    def fill(self, stored: Sequence[torch.Tensor]) -> None:
        """Copy a batch's stored tensors into the slot's host buffer (one memcpy each)."""
        for host, host_np, src in zip(self.host, self.host_np, stored, strict=True):
            if host_np is not None:
                np.copyto(host_np, src.numpy(), casting="no")
            else:
                host.copy_(src)


def fuse(
    fields: Sequence[torch.Tensor], served: Sequence[torch.dtype]
) -> list[tuple[torch.Tensor, torch.dtype, int]]:
    """Consecutive fields that are one view shape of one dtype at evenly spaced offsets (and
    served as one dtype), each as (a [k, ...] strided view over all k of them, their served
    dtype, k). A lone field is a group of one. Works on metadata alone: no kernel runs."""
    groups: list[tuple[torch.Tensor, torch.dtype, int]] = []
    i, n = 0, len(fields)
    while i < n:
        first = fields[i]
        j, step = i + 1, 0
        while j < n and served[j] == served[i] and _alike(fields[j], first):
            gap = int(fields[j].storage_offset()) - int(fields[j - 1].storage_offset())
            if gap <= 0 or (step and gap != step):
                break
            step = gap
            j += 1
        shape = (j - i, *first.shape)
        strides = (step or 1, *first.stride())
        groups.append((first.as_strided(shape, strides, first.storage_offset()), served[i], j - i))
        i = j
    return groups


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def widen(groups: Sequence[tuple[torch.Tensor, torch.dtype, int]]) -> list[torch.Tensor]:
    """The served fields of fused groups: one kernel per group into new contiguous memory."""
    if len(groups) == 1:
        src, dtype, _ = groups[0]
        return list(src.to(dtype, memory_format=torch.contiguous_format, copy=True).unbind(0))
    out: list[torch.Tensor] = []
    for src, dtype, _ in groups:
        out.extend(src.to(dtype, memory_format=torch.contiguous_format, copy=True).unbind(0))
    return out
