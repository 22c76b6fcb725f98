"""A split's stream whose files a fetch helper process leases, verifies and copies into a ring
of shared memory (fetch_helper.py, helper_link.py): QueueClient(fetch_process=True).

Everything that decides what is read stays here, as in SplitStream: the seqs in order, a
resume's plan, rows of any batch size across files, the read-ahead. Only the fetch moves: the
stream names the next file and a free slot in one message, and at a switch takes the file the
helper put there, as tensors viewing the slot (views made once per slot). A file read to its
end is handed back in one message; the helper releases its lease and the slot is free again.
No thread of the trainer's process does anything between two get_batch calls.

Batches are never views of a slot: the slot is refilled once its file is handed back, while a
trainer may keep a batch for longer. Fields stored as served are copied out (one copy per
call); narrow ids are widened into new memory as in SplitStream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from queue_client import errors
from queue_client.format.schema import FieldSpec
from queue_client.helper.helper_link import HelperLink, SlotFile
from queue_client.streaming.resume import StreamPlan
from queue_client.streaming.rows import LoadedFile
from queue_client.streaming.stream import SplitStream
from queue_client.streaming.stream_api import LeaseRef, LeaseSource
from queue_client.streaming.transfer import Transfer
from queue_client.wire import batchqueue_pb2 as pb


class _SlotJob:
    """A file asked of the helper: its slot, and its answer once read off the link."""

    def __init__(self, stream: HelperStream, slot: int, submitted: float) -> None:
        self.stream = stream
        self.slot = slot
        self.submitted = submitted
        self._file: SlotFile | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        if self._file is not None or self._error is not None:
            return True
        return self.stream.link.arrived(self.stream.split, self.slot)

    def result(self, timeout: float | None = None) -> SlotFile:
        if self._error is not None:
            raise self._error
        if self._file is None:
            wait = self.stream.timeout_s if timeout is None else timeout
            try:
                self._file = self.stream.link.wait(
                    self.stream.split, self.slot, self.stream.clock() + wait + 10.0
                )
            except BaseException as exc:
                self._error = exc
                raise
        return self._file

    def cancel(self) -> bool:
        return False  # the helper is at it already: its answer is awaited and given back


class _NoLane:
    """What a helper stream has instead of background threads: whether it was closed."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise errors.InvalidRequest(f"{self.owner} was closed: it fetches no more files")

    def stop(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


class HelperStream(SplitStream):
    def __init__(
        self,
        source: LeaseSource,
        split: str,
        schema: tuple[FieldSpec, ...],
        *,
        link: HelperLink,
        plan: StreamPlan | None,
        seq_stride: int,
        prefetch: int,
        timeout_s: float,
        clock: Callable[[], float],
        dependence: str = "",
    ) -> None:
        self.link = link
        super().__init__(
            source, split, schema, plan=plan, seq_stride=seq_stride, prefetch=prefetch,
            timeout_s=timeout_s, clock=clock, dependence=dependence,
        )  # fmt: skip
        # The deepest read-ahead, the file being read, and one more for a batch that ends
        # one file and starts the next.
        # A split's ring is made once per helper: a stream opened again (a resume) keeps it.
        self.slots = link.ring_slots.setdefault(split, max(1, self.read_ahead.cap) + 2)
        self._free = list(range(self.slots))
        self._slot_of: dict[int, int] = {}  # id(LeaseRef) -> its slot
        # A LoadedFile's derived views per (slot, seq-free shape): rebuilt only when a slot
        # holds a file of another shape.
        self._templates: dict[tuple[int, int, int], LoadedFile] = {}
        # Per served field, whether a zero-copy batch of it would view the ring (a field
        # stored as served): those are copied out. Known at the first batch.
        self._clone: list[bool] | None = None
        self._any_clone = False

    def _make_lane(self) -> Any:
        return _NoLane(f"the {self.source.dataset}/{self.split} stream")

    # ---- the hot path: as SplitStream, but never a view of a slot -------------------------
    def next_batch(self, transfer: Transfer, size: int) -> list[torch.Tensor]:
        tensors = super().next_batch(transfer, size)
        if not transfer.serves_views:
            return tensors  # copies and devices: new memory already
        if self._any_clone:
            clone = self._clone
            assert clone is not None  # set with _any_clone, at the first file
            return [t.clone() if c else t for t, c in zip(tensors, clone, strict=True)]
        return tensors

    def _probe_views(self, loaded: LoadedFile) -> None:
        """Which served fields a zero-copy batch gets as views of the ring (fields stored as
        served): a one-row batch of the first file, looked at once. Batches that cross
        files are new memory anyway; within a file the same fields are views every call."""
        ring = self.link.rings[self.split].base.untyped_storage().data_ptr()
        probe = loaded.views(0, min(1, loaded.rows))
        self._clone = [t.untyped_storage().data_ptr() == ring for t in probe]
        self._any_clone = any(self._clone)

    # ---- file boundaries ------------------------------------------------------------------
    def _submit(self) -> None:
        self._ask()

    def _ask(self) -> None:
        """Name the next file in line and a free slot to the helper; pending from now."""
        self._lane.check_open()
        if not self._free:
            raise errors.InvalidRequest(
                f"{self.source.dataset}/{self.split}: every one of the {self.slots} ring slots "
                "is in use"
            )
        slot = self._free.pop()
        seq, offset, carried = self._take()
        self.link.fetch(self.split, slot, self.slots, seq, carried)
        job = _SlotJob(self, slot, self.clock())
        self._pending.append((job, None if seq is None else (seq, offset)))  # type: ignore[arg-type]

    def _advance(self) -> None:
        if not self._pending:
            self._hand_back_finished()
            self._submit()
        job, item = self._pending.popleft()
        assert isinstance(job, _SlotJob)
        began = self.clock()
        try:
            slot_file = job.result()
        except BaseException:
            self._free.append(job.slot)
            self._give_back_pending(item)
            raise
        now = self.clock()
        self.read_ahead.fetched(now - job.submitted)
        try:
            loaded = self._loaded(slot_file, item)
        except BaseException:
            self.link.done(self.split, job.slot, False)  # unread: the helper returns it
            self._free.append(job.slot)
            self._give_back_pending(item)
            raise
        loaded.waited_s = now - began
        if self.current is not None:
            self._finished.append(self.current)
            self.read_ahead.read(now - self._opened_at)
        self._opened_at = now
        self.current = loaded
        self.row = min(loaded.start, loaded.rows)

    def _loaded(self, f: SlotFile, item: tuple[int, int] | None) -> LoadedFile:
        if item is not None and item[0] != f.seq:
            raise errors.CorruptBatchFile(
                f"{self.source.dataset}/{self.split}: the fetch helper put seq {f.seq} in slot "
                f"{f.slot}, asked for seq {item[0]}"
            )
        ref = LeaseRef(f.lease_id, self.source.dataset, self.split, f.seq)
        key = (f.slot, f.num_batches, f.batch_size)
        template = self._templates.get(key)
        if template is None or any(
            a is not b for a, b in zip(template.stored, f.stored, strict=True)
        ):
            # The helper moves bytes; what they are is checked here, once per layout.
            try:
                self.codec.check_stored(
                    dict(zip(self.codec.stored_names, f.stored, strict=True)),
                    (f.num_batches, f.batch_size),
                )
            except errors.SchemaMismatch as exc:
                raise errors.SchemaMismatch(
                    f"{self.source.dataset}/{self.split} seq {f.seq}, from the fetch helper: {exc}"
                ) from None
            # Every slot's at once, for files of this shape: the switches to come find theirs
            # made (each costs the trainer's thread some 100 µs of torch calls to make).
            for s in range(self.slots):
                views = f.stored if s == f.slot else self.link.views(self.split, s, f.layout)
                self._templates[(s, f.num_batches, f.batch_size)] = LoadedFile(
                    ref, f.seq, f.num_batches, f.batch_size, self.codec, views
                )
            template = self._templates[key]
        loaded = template.__class__.__new__(template.__class__)
        loaded.__dict__.update(template.__dict__)
        loaded.lease, loaded.seq, loaded.first, loaded.waited_s = ref, f.seq, None, 0.0
        loaded.start = item[1] if item is not None else 0
        self._slot_of[id(ref)] = f.slot
        if self._clone is None:
            self._probe_views(loaded)
        return loaded

    def _after_switch(self) -> None:
        """Hand the finished files back (their slots free again) and ask for the next ones,
        up to the read-ahead and the free slots: a few messages, no thread woken here."""
        self._hand_back_finished()
        while len(self._pending) < self.read_ahead.depth and self._free:
            self._ask()
        self.link.flush()

    def _hand_back_finished(self) -> None:
        finished, self._finished = self._finished, []
        for f in finished:
            self._give_back(f, pb.CONSUMED, f.waited_s)

    def _give_back(self, f: LoadedFile, outcome: pb.ReleaseOutcome, waited_s: float = 0.0) -> None:
        slot = self._slot_of.pop(id(f.lease), None)
        if slot is None or f.lease.released:
            return
        f.lease.released = True
        self.link.done(self.split, slot, outcome == pb.CONSUMED, waited_s)
        self._free.append(slot)

    def _give_back_pending(
        self, first: tuple[int, int] | None = None, skipped: frozenset[int] = frozenset()
    ) -> None:
        """Return every file asked for (once the helper has it) and put them back in line;
        the helper releases those in `skipped` as consumed."""
        items = [first] if first is not None else []
        while self._pending:
            job, item = self._pending.popleft()
            assert isinstance(job, _SlotJob)
            if item is not None:
                items.append(item)
            try:
                job.result()
            except BaseException:
                self._free.append(job.slot)  # nothing held: the helper reported the failure
                continue
            consumed = item is not None and item[0] in skipped
            self.link.done(self.split, job.slot, consumed)
            self._free.append(job.slot)
        self._plan.extendleft(reversed(items))

    def close(self, skipped: frozenset[int] = frozenset()) -> None:
        """Give back what this stream holds (a finished file as consumed, the rest unread);
        a helper that is gone has given its files back already, or they expire."""
        try:
            if not self.link.closed:
                super().close(skipped)
        finally:
            self._lane.close()
            self._finished, self.current, self.row = [], None, 0


def open_helper_stream(
    client: Any,
    link: HelperLink,
    split: str,
    schema: tuple[FieldSpec, ...],
    plan: StreamPlan | None,
) -> HelperStream:
    """`client`'s stream of `split` through its fetch helper; refused, naming the split, for
    files that store a tensor per batch (a ring slot holds rows)."""
    import time

    from queue_client.format.storage import codec_for
    from queue_client.streaming.rows import rows_dependence

    codec = codec_for(schema)
    if any(f.storage.exceptions for f in codec.schema):
        raise errors.InvalidRequest(
            "fetch_process=True serves files whose stored tensors are all per row; "
            f"{client.dataset}/{split} stores end-of-document exceptions per batch"
        )
    return HelperStream(
        client,
        split,
        schema,
        link=link,
        plan=plan,
        seq_stride=client.world.world_size,
        prefetch=client.prefetch_files,
        timeout_s=client.timeout_s,
        clock=time.monotonic,
        dependence=rows_dependence(client.meta, codec, split),
    )
