"""A leased, loaded batch file as rows: the unit a trainer's batch of any size is cut from.

A file holds num_batches x batch_size rows (its batch_size is the file's unit, recorded in
meta). Each stored tensor of shape [num_batches, batch_size, ...] is seen as [rows, ...] (a
view: no copy), so rows r0..r1 are one slice, whichever batches they fall in. A stored
tensor kept per batch (the end-of-document exceptions of [A, B, T] layouts) is sliced by
batch instead; such datasets serve only whole, aligned batches (see `rows_dependence`).

Decoding is per request, never per file: narrow ids are widened one request at a time
straight into the tensors handed out (`serve_rows_into`, one `copy_` per field), so the
trainer's process spends on decoding what the batches it takes cost, and a file switch
costs no decode at all. Trainers that take zero-copy CPU batches get views of the file
where it stores the fields as served, else the rows widened into a batch's worth of memory
of their own (`views`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from queue_client.format.schema import torch_dtype
from queue_client.format.storage import BatchCodec
from queue_client.streaming.transfer import StoredBatch

if TYPE_CHECKING:
    from queue_client.streaming.stream_api import LeaseRef


def rows_dependence(meta: Mapping[str, Any], codec: BatchCodec, split: str = "") -> str:
    """Why a dataset's rows cannot be served in batches of another size than its files'
    (an empty string when they can): a batch that is one optimizer step of A micro-batches
    ([A, B, T], meta's grad_accum), a batch composed as a whole (a curriculum split), or a
    storage that describes a batch, not its rows."""
    if split and split in (meta.get("composed_splits") or ()):
        return (
            'it is a curriculum split, whose batches are composed whole (selection = "curriculum")'
        )
    if meta.get("grad_accum") is not None:
        return (
            f"its batches are [A, B, T] grad-accumulation layouts (grad_accum = "
            f"{meta.get('grad_accum')}): one batch is one optimizer step of A micro-batches"
        )
    if any(f.storage.exceptions for f in codec.schema):
        return "its files store end-of-document exceptions per batch, not per row"
    return ""


# The most bytes one batch's served fields may take: far above a rank's batch on any device
# (8192-token rows of int64 x and y are 128 KiB a row, so 131072 rows), it turns a mistyped
# batch_size into a message naming it instead of a request to torch's allocator for more
# memory than a machine has. A batch may span any number of files (stream.py releases each
# as its rows are copied), so memory is the only bound.
MAX_BATCH_BYTES = 16 * 2**30


def max_batch_rows(row_bytes: int) -> int:
    """The most rows of `row_bytes` served bytes each that one batch may hold (at least 1)."""
    return max(1, MAX_BATCH_BYTES // max(1, row_bytes))


def batch_size_of(value: object) -> int | None:
    """`value` as a batch size: a Python or numpy integer >= 1 (bools are not sizes), else
    None for the caller to refuse in its own words."""
    if isinstance(value, bool):
        return None
    try:
        size = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return size if size >= 1 else None


@dataclass
class LoadedFile:
    """A file ready to serve rows from: mapped (or streamed), verified, paged in."""

    lease: LeaseRef
    seq: int
    num_batches: int
    batch_size: int  # the file's unit: rows per batch as stored
    codec: BatchCodec  # how this file stores the schema's fields
    stored: list[torch.Tensor]  # codec.stored_names order, each [num_batches, ...]
    row_stored: list[torch.Tensor] = field(init=False)  # [rows, ...], or [nb, ...] per batch
    rowwise: list[bool] = field(init=False)
    row_fields: list[torch.Tensor | None] = field(init=False)  # codec.field_views(row_stored)
    # Per served field, [rows, ...]: the file's own tensors when it stores the fields as
    # served; None when they are decoded per request.
    served: list[torch.Tensor] | None = None
    start: int = 0  # the first row to serve: later than 0 when resuming mid-file
    waited_s: float = 0.0  # how long get_batch blocked for this file
    # The first batch, widened ahead by the background: (first row, end row, its tensors).
    first: tuple[int, int, list[torch.Tensor]] | None = None
    # Per served field, its [rows, ...] values and the dtype they are served as, when each
    # is one widening copy of a slice of them (x and y of a window): `views` then skips
    # the codec's general path.
    widen: list[tuple[torch.Tensor, torch.dtype]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        nb, bs = self.num_batches, self.batch_size
        self.rows = nb * bs
        self.rowwise = [t.dim() >= 2 and tuple(t.shape[:2]) == (nb, bs) for t in self.stored]
        self.row_stored = [
            t.reshape(self.rows, *t.shape[2:]) if rw else t
            for t, rw in zip(self.stored, self.rowwise, strict=True)
        ]
        self.row_fields = self.codec.field_views(self.row_stored)
        if self.codec.identity:
            self.served = self.row_fields  # type: ignore[assignment]  # identity: all direct
        elif (
            self.codec.copies_only
            and all(self.rowwise)
            and all(f is not None for f in self.row_fields)
        ):  # every field a view of the stored rows: each call widens them itself
            self.widen = [
                (f, torch_dtype(spec.dtype))
                for f, spec in zip(self.row_fields, self.codec.schema, strict=True)
                if f is not None
            ]

    def stored_rows(self, r0: int, r1: int) -> list[torch.Tensor]:
        """Rows r0..r1 of every stored tensor (a per-batch one: the batch r0 lies in)."""
        b = r0 // self.batch_size
        return [
            t[r0:r1] if rw else t[b] for t, rw in zip(self.row_stored, self.rowwise, strict=True)
        ]

    def stored_batch(self, r0: int, r1: int) -> StoredBatch:
        """Rows r0..r1 as a stored batch, for copies and devices (transfer.py); its field
        views are sliced only if used (a device transfer reads the stored tensors alone)."""
        return StoredBatch(self.codec, None, self.stored_rows(r0, r1), (self.row_fields, r0, r1))

    def serve_rows_into(self, r0: int, r1: int, outs: Sequence[torch.Tensor]) -> None:
        """Rows r0..r1's served fields written into `outs` (one widening copy_ per field)."""
        fields = [None if f is None else f[r0:r1] for f in self.row_fields]
        self.codec.serve_into(fields, self.stored_rows(r0, r1), outs)

    def prepare_first(self, size: int) -> None:
        """Widen the first batch of `size` rows now (in the background, where the file is
        fetched), so that the call that switches to this file only hands it out. Nothing
        to do for a file that stores the fields as served: its views cost nothing."""
        r0 = min(self.start, self.rows)
        if not self.codec.identity and r0 + size <= self.rows:
            self.first = (r0, r0 + size, self.views(r0, r0 + size))

    def first_views(self, r0: int, r1: int) -> list[torch.Tensor]:
        """`views(r0, r1)`, handed over ready when they are the batch widened ahead (once:
        the trainer owns them from then on)."""
        first, self.first = self.first, None
        if first is not None and first[0] == r0 and first[1] == r1:
            return first[2]
        return self.views(r0, r1)

    def views(self, r0: int, r1: int) -> list[torch.Tensor]:
        """Rows r0..r1's served fields, for a trainer that takes zero-copy CPU batches: views
        of the file where it stores them as served, else widened now into memory of their
        own (a batch's worth: the allocator reuses it once the trainer lets it go, so no page
        is faulted in steady state, and autograd may keep any batch alive safely)."""
        if self.codec.identity:
            return [t[r0:r1] for t in self.served]  # type: ignore[union-attr]  # set above
        if self.widen is not None:
            return [f[r0:r1].to(dtype) for f, dtype in self.widen]
        fields = [None if f is None else f[r0:r1] for f in self.row_fields]
        return self.codec.serve(fields, self.stored_rows(r0, r1))
