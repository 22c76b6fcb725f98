"""The device path's staging, where no GPU is needed: the ring's slot and fence bookkeeping as
pure logic (a fence the test completes by hand), the layouts and fused widening on metadata,
and the whole staged transfer run on the CPU (CPU buffers in the ring) against the CPU's own
batches, for every kind of codec. tests/test_cuda.py runs the same path on a GPU."""

from __future__ import annotations

import pytest
import torch

from queue_client.format.schema import parse_schema
from queue_client.format.storage import BatchCodec
from queue_client.streaming.staging_layout import Layout, fuse
from queue_client.streaming.staging_ring import MIN_SLOT_BYTES, StagingRing, slot_bytes
from queue_client.streaming.transfer import StoredBatch, Transfer
from queue_providers.compact import lm_window_schema


class HandFence:
    """A fence the test completes: pending from record() until done() or synchronize()."""

    def __init__(self) -> None:
        self.pending = False
        self.waited = 0

    def record(self) -> None:
        self.pending = True

    def query(self) -> bool:
        return not self.pending

    def synchronize(self) -> None:
        self.waited += 1
        self.pending = False

    def done(self) -> None:
        self.pending = False


def cpu_ring(*, min_slots: int = 2, max_slots: int = 4) -> StagingRing:
    def alloc(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    return StagingRing(alloc, alloc, HandFence, min_slots=min_slots, max_slots=max_slots)


def fence(slot: object) -> HandFence:
    f = slot.fence  # type: ignore[attr-defined]
    assert isinstance(f, HandFence)
    return f


# ---- the ring ---------------------------------------------------------------------------------
def test_slots_are_reused_round_robin_once_their_fences_pass() -> None:
    ring = cpu_ring()
    got = []
    for _ in range(6):
        slot = ring.acquire(1000)
        fence(slot).record()
        got.append(slot)
        fence(slot).done()  # the GPU kept up
    assert len(ring.slots) == 2 and ring.waits == 0
    assert [id(s) for s in got] == [id(got[0]), id(got[1])] * 3
    ptrs = {s.host.data_ptr() for s in got}
    assert len(ptrs) == 2  # no buffer made again


def test_a_slot_the_gpu_still_reads_is_never_handed_out_while_the_ring_may_grow() -> None:
    ring = cpu_ring(max_slots=4)
    busy = []
    for _ in range(4):
        slot = ring.acquire(100)
        assert all(slot is not b for b in busy)
        fence(slot).record()  # never done: a GPU far behind
        busy.append(slot)
    assert len(ring.slots) == 4 and ring.waits == 0
    # Full: the fifth call waits for the oldest (back-pressure), and only that one.
    fifth = ring.acquire(100)
    assert fifth is busy[0] and ring.waits == 1 and fence(fifth).waited == 1
    assert all(fence(b).waited == 0 for b in busy[1:])


def test_a_grown_ring_keeps_least_recently_used_order() -> None:
    ring = cpu_ring(max_slots=3)
    a = ring.acquire(10)
    fence(a).record()
    b = ring.acquire(10)
    fence(b).record()
    fence(b).done()
    # a is still busy: a new slot takes its turn, and a stays next in line.
    c = ring.acquire(10)
    assert c is not a and c is not b and len(ring.slots) == 3
    fence(c).record()
    fence(a).done()
    assert ring.acquire(10) is a
    assert ring.acquire(10) is b


def test_a_slot_grows_once_for_a_larger_batch_and_holds_smaller_ones() -> None:
    ring = cpu_ring(min_slots=1, max_slots=1)
    slot = ring.acquire(10)
    assert slot.capacity == MIN_SLOT_BYTES
    slot.views["layout"] = object()
    first = slot.host.data_ptr()
    assert ring.acquire(MIN_SLOT_BYTES).host.data_ptr() == first
    grown = ring.acquire(MIN_SLOT_BYTES + 1)
    assert grown is slot and slot.capacity == 2 * MIN_SLOT_BYTES
    assert slot.views == {}  # views of the old buffers dropped
    assert slot.device is not None and slot.device.numel() == slot.capacity
    ring.acquire(100)
    assert slot.capacity == 2 * MIN_SLOT_BYTES and ring.last_nbytes == 100


@pytest.mark.parametrize(
    ("nbytes", "capacity"),
    [(0, MIN_SLOT_BYTES), (1, MIN_SLOT_BYTES), (MIN_SLOT_BYTES, MIN_SLOT_BYTES),
     (MIN_SLOT_BYTES + 1, 2 * MIN_SLOT_BYTES), (24_640, 32_768), (32_768, 32_768)],
)  # fmt: skip
def test_slot_bytes(nbytes: int, capacity: int) -> None:
    assert slot_bytes(nbytes) == capacity


def test_bad_slot_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="min_slots <= max_slots"):
        cpu_ring(min_slots=3, max_slots=2)


# ---- layouts and fused widening ----------------------------------------------------------------
def window_codec(t: int = 16, vocab: int = 300) -> BatchCodec:
    return BatchCodec(parse_schema(lm_window_schema(t, vocab)))


def test_x_and_y_of_a_window_are_one_group_one_token_apart() -> None:
    codec = window_codec()
    w = torch.zeros(3, 17, dtype=torch.uint16)
    groups = fuse(codec.field_views([w]), [torch.int64, torch.int64])  # type: ignore[arg-type]
    assert len(groups) == 1
    src, dtype, k = groups[0]
    assert k == 2 and dtype == torch.int64
    assert src.shape == (2, 3, 16) and src.stride() == (1, 17, 1)


def test_fields_of_other_shapes_or_dtypes_are_groups_of_their_own() -> None:
    flat = torch.zeros(64, dtype=torch.int32)
    a, b, c = flat[0:8].view(2, 4), flat[8:16].view(2, 4), flat[16:24].view(4, 2)
    i64 = torch.int64
    assert [k for _, _, k in fuse([a, b, c], [i64, i64, i64])] == [2, 1]
    assert [k for _, _, k in fuse([a, b], [i64, torch.int32])] == [1, 1]
    assert [k for _, _, k in fuse([b, a], [i64, i64])] == [1, 1]  # no negative stride


def test_a_layout_puts_each_stored_tensor_at_a_64_byte_boundary() -> None:
    stored = [torch.zeros(3, 17, dtype=torch.uint16), torch.zeros(3, dtype=torch.uint8)]
    layout = Layout(None, stored)
    assert [p.offset for p in layout.parts] == [0, 128]
    assert [p.nbytes for p in layout.parts] == [102, 3]
    assert layout.nbytes == 192


# ---- the staged transfer on the CPU -------------------------------------------------------------
def test_staged_batches_are_the_cpu_batches_in_new_contiguous_memory() -> None:
    codec = window_codec()
    transfer = Transfer("cpu", ring=cpu_ring())
    kept, want = [], []
    for i in range(12):
        w = (torch.arange(3 * 17).view(3, 17) * 7 + i) % 300
        w = w.to(torch.uint16)
        batch = StoredBatch(codec, codec.field_views([w]), [w])
        want.append(codec.serve(batch.fields, batch.stored, copy=True))
        kept.append(transfer.deliver(batch))
        for slot in transfer.ring.slots:  # type: ignore[union-attr]
            fence(slot).done()
    slot_memory = {
        s.device.untyped_storage().data_ptr()
        for s in transfer.ring.slots  # type: ignore[union-attr]
        if s.device is not None
    }
    for (x, y), (wx, wy) in zip(kept, want, strict=True):  # no batch overwritten by reuse
        assert torch.equal(x, wx) and torch.equal(y, wy)
        assert x.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
        assert x.untyped_storage().data_ptr() not in slot_memory
    assert transfer.ring.last_nbytes == 128  # type: ignore[union-attr]  # 3 x 17 uint16, aligned
    assert len(transfer.ring.slots) == 2  # type: ignore[union-attr]


def test_staged_plain_views_are_copied_as_they_are() -> None:
    transfer = Transfer("cpu", ring=cpu_ring())
    x = torch.arange(12, dtype=torch.int64).view(3, 4)
    y = torch.arange(12, 24, dtype=torch.int64).view(3, 4)
    gx, gy = transfer([x, y])
    assert torch.equal(gx, x) and torch.equal(gy, y)
    assert gx.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert gx.is_contiguous() and gy.is_contiguous()


def test_staged_out_buffers_get_the_widened_fields() -> None:
    codec = window_codec()
    transfer = Transfer("cpu", ring=cpu_ring())
    w = ((torch.arange(3 * 17) * 5) % 300).view(3, 17).to(torch.uint16)
    batch = StoredBatch(codec, codec.field_views([w]), [w])
    out = (torch.full((3, 16), -1, dtype=torch.int64), torch.full((3, 16), -1, dtype=torch.int64))
    transfer.deliver_into(batch, out)
    assert torch.equal(out[0], w[:, :-1].long()) and torch.equal(out[1], w[:, 1:].long())
