"""Served fields from stored tensors, and back: the codec of a batch file's compact storage.

A batch file (format version 2 or 3) stores what a schema's `Storage` says (schema.py): token ids
in the narrowest dtype that holds the vocabulary, x and y as two views of one window of T+1
tokens, and no masks or segment ids that follow from the ids. `BatchCodec` reads a batch
from those stored tensors in the dtypes and shapes the schema promises, and writes them from
a batch (for providers, checking that what it wrote reads back the same).

Every operation works on any leading shape, so one code path serves a whole file (decoded at
once in a background thread), one batch on the CPU, and one batch on a CUDA device after the
narrow tensors crossed the link. Narrow unsigned tensors only ever meet `copy_`/`to` and
slicing, the operations torch implements for them on every device; comparisons run on the
widened fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from queue_client.errors import SchemaMismatch
from queue_client.format.schema import (
    AFTER_FIRST,
    DOCUMENT_KINDS,
    LENGTH_MASK,
    NEXT_TOKEN,
    NOT_EQUAL,
    PLAIN,
    SEGMENTS,
    FieldSpec,
    dtype_name,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

EXCEPTIONS_DTYPE = "int32"


class BatchCodec:
    """Turns a schema's stored tensors into its served fields (and back), for any leading shape.

    `stored_names` are the stored tensors in file order; `field_views` gives, per served field,
    the narrow view its values come from (None for a derived field); `serve` and `serve_into`
    finish the batch. `identity` means the file holds the served fields themselves.
    """

    def __init__(self, schema: Sequence[FieldSpec]) -> None:
        self.schema = tuple(schema)
        self.names = [f.name for f in self.schema]
        self._index = {f.name: i for i, f in enumerate(self.schema)}
        names: list[str] = []
        for f in self.schema:
            if f.storage.direct and f.stored_name not in names:
                names.append(f.stored_name)
        for f in self.schema:
            for aux in (f.storage.lengths, f.storage.exceptions):
                if aux and aux not in names:
                    names.append(aux)
        self.stored_names: tuple[str, ...] = tuple(names)
        self._slot = {n: i for i, n in enumerate(names)}
        # Per field: (slot of its stored tensor, offset, length) when direct, else None.
        self._direct: list[tuple[int, int, int] | None] = []
        for f in self.schema:
            if f.storage.direct:
                n = f.shape[-1] if f.storage.kind != PLAIN else -1
                self._direct.append((self._slot[f.stored_name], f.storage.offset, n))
            else:
                self._direct.append(None)
        self.identity = all(
            f.storage.kind == PLAIN and f.stored_name == f.name and f.stored_as == f.dtype
            for f in self.schema
        )
        # Fields whose served values need work after the copy, in an order that has each
        # field's sources ready first (direct fields before derived ones).
        self._finish = [i for i, f in enumerate(self.schema) if f.storage.kind == NEXT_TOKEN]
        self._derived = [i for i, f in enumerate(self.schema) if not f.storage.direct]
        self._copies_only = not self._finish and not self._derived

    @cached_property
    def _dtypes(self) -> list[torch.dtype]:
        """The served fields' torch dtypes, looked up on first read: a writer that encodes
        with numpy (char_lm's workers) never imports torch."""
        return [torch_dtype(f.dtype) for f in self.schema]

    # ---- reading -------------------------------------------------------------------------
    def field_views(self, stored: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per served field, the view of `stored` (in stored_names order) holding its values
        in the stored dtype; None for a derived field."""
        out: list[torch.Tensor | None] = []
        for where in self._direct:
            if where is None:
                out.append(None)
                continue
            slot, offset, n = where
            t = stored[slot]
            out.append(t if n < 0 else t[..., offset : offset + n])
        return out

    def serve(
        self,
        fields: Sequence[torch.Tensor | None],
        stored: Sequence[torch.Tensor],
        *,
        copy: bool = False,
    ) -> list[torch.Tensor]:
        """The served fields, newly allocated where they need widening or work (or `copy`);
        a field stored as served is returned as the view itself unless `copy`."""
        import torch

        served: list[torch.Tensor | None] = [None] * len(self.schema)
        for i, view in enumerate(fields):
            if view is None:
                continue
            dtype = self._dtypes[i]
            if copy or i in self._finish:
                served[i] = torch.empty(view.shape, dtype=dtype, device=view.device).copy_(view)
            else:
                served[i] = view.to(dtype)
        scratch: dict[str, object] = {}
        for i in self._finish:
            t = served[i]
            assert t is not None
            t.masked_fill_(
                self._not_next(i, served, stored, scratch), self.schema[i].storage.ignore
            )
        for i in self._derived:
            served[i] = self._derive(i, served, stored, scratch)
        return served  # type: ignore[return-value]  # every slot was filled above

    def serve_into(
        self,
        fields: Sequence[torch.Tensor | None],
        stored: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor],
    ) -> None:
        """The served fields written into `outs` (one copy_ per direct field, widening as it
        goes), then the derived ones computed from those."""
        if self._copies_only:  # x and y of a window, ids stored narrow: one copy_ each
            for out, view in zip(outs, fields, strict=True):
                out.copy_(view)  # type: ignore[arg-type]  # no derived field: never None
            return
        for out, view in zip(outs, fields, strict=True):
            if view is not None:
                out.copy_(view)
        served: list[torch.Tensor | None] = list(outs)
        scratch: dict[str, object] = {}
        for i in self._finish:
            outs[i].masked_fill_(
                self._not_next(i, served, stored, scratch), self.schema[i].storage.ignore
            )
        for i in self._derived:
            outs[i].copy_(self._derive(i, served, stored, scratch))

    @property
    def copies_only(self) -> bool:
        """Whether every served field is one widening copy of a stored slice (nothing
        finished or derived): a reader may then widen the views itself."""
        return self._copies_only

    def decode(self, stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every served field of a mapping of stored tensors (a whole file, or one batch)."""
        tensors = [stored[n] for n in self.stored_names]
        served = self.serve(self.field_views(tensors), tensors, copy=True)
        return dict(zip(self.names, served, strict=True))

    # ---- derived fields ----------------------------------------------------------------------
    def _derive(
        self,
        i: int,
        served: Sequence[torch.Tensor | None],
        stored: Sequence[torch.Tensor],
        scratch: dict[str, object],
    ) -> torch.Tensor:
        import torch

        f = self.schema[i]
        st = f.storage
        dtype = self._dtypes[i]
        if st.kind == NOT_EQUAL:
            src = served[self._index[st.source]]
            assert src is not None
            return (src != st.value).to(dtype)
        if st.kind == AFTER_FIRST:
            src = served[self._index[st.source]]
            assert src is not None
            hit = (src == st.value).to(torch.int32)
            before = hit.cumsum(-1) - hit  # how many separators come before each position
            return ((before > 0) & (src != st.pad)).to(dtype)
        ends, pad = self._documents(i, served, stored, scratch)
        if st.kind == SEGMENTS:
            counted = ends.to(torch.int32)
            seg = counted.cumsum(-1, dtype=torch.int32) - counted + 1
            if pad is not None:
                seg.masked_fill_(pad, 0)
            return seg.to(dtype)
        assert st.kind == LENGTH_MASK
        if pad is None:
            return torch.ones(ends.shape, dtype=dtype, device=ends.device)
        return (~pad).to(dtype)

    def _not_next(
        self,
        i: int,
        served: Sequence[torch.Tensor | None],
        stored: Sequence[torch.Tensor],
        scratch: dict[str, object],
    ) -> torch.Tensor:
        """Where a next_token field holds no next token: at document ends and padding."""
        ends, pad = self._documents(i, served, stored, scratch)
        return ends if pad is None else ends | pad

    def _documents(
        self,
        i: int,
        served: Sequence[torch.Tensor | None],
        stored: Sequence[torch.Tensor],
        scratch: dict[str, object],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(document ends, padding) of field i's rows, computed once per batch and shared."""
        st = self.schema[i].storage
        key = f"{st.ids}/{st.value}/{st.lengths}/{st.exceptions}"
        known = scratch.get(key)
        if known is not None:
            return known  # type: ignore[return-value]  # stored below as this very tuple
        import torch

        ids = served[self._index[st.ids]]
        assert ids is not None
        pad = None
        if st.lengths:
            lengths = stored[self._slot[st.lengths]].to(torch.int64)
            positions = torch.arange(ids.shape[-1], device=ids.device)
            pad = positions >= lengths.unsqueeze(-1)
        ends = ids == st.value
        if pad is not None:
            ends &= ~pad
        if st.exceptions:
            exc = stored[self._slot[st.exceptions]]
            if exc.numel():
                ends = _clear(ends, exc)
        scratch[key] = (ends, pad)
        return ends, pad

    # ---- checking ------------------------------------------------------------------------
    def check_stored(self, tensors: Mapping[str, torch.Tensor], lead: tuple[int, ...]) -> None:
        """Raise SchemaMismatch naming the first stored tensor whose name, dtype or shape does
        not fit the schema. `lead` is (num_batches, batch_size) for a file, (batch_size,) for
        one batch."""
        import torch

        extra = sorted(set(tensors) - set(self.stored_names))
        if extra:
            raise SchemaMismatch(
                f"stored tensors {extra} are not in the schema's {list(self.stored_names)}"
            )
        for name in self.stored_names:
            if name not in tensors:
                raise SchemaMismatch(f"stored tensor {name!r} is missing from the batch")
            if not isinstance(tensors[name], torch.Tensor):
                raise SchemaMismatch(f"stored tensor {name!r} is not a tensor")
        for f in self.schema:
            st = f.storage
            if f.storage.direct:
                t = tensors[f.stored_name]
                if dtype_name(t.dtype) != f.stored_as:
                    raise SchemaMismatch(
                        f"stored tensor {f.stored_name!r} of field {f.name!r} has dtype "
                        f"{dtype_name(t.dtype)}, schema says {f.stored_as}"
                    )
                if st.kind == PLAIN:
                    want = (*lead, *f.shape)
                    ok = tuple(t.shape) == want
                else:
                    want = (*lead, *f.shape[:-1], st.offset + f.shape[-1])
                    ok = tuple(t.shape[:-1]) == want[:-1] and t.shape[-1] >= want[-1]
                if not ok:
                    raise SchemaMismatch(
                        f"stored tensor {f.stored_name!r} of field {f.name!r} has shape "
                        f"{tuple(t.shape)}, schema says {want}"
                        + ("" if st.kind == PLAIN else " (or wider in the last dimension)")
                    )
            if st.kind in DOCUMENT_KINDS and st.lengths:
                t = tensors[st.lengths]
                want = (*lead, *f.shape[:-1])
                if tuple(t.shape) != want or t.dtype.is_floating_point or t.dtype == torch.bool:
                    raise SchemaMismatch(
                        f"stored lengths {st.lengths!r} of field {f.name!r} are "
                        f"{dtype_name(t.dtype)} {tuple(t.shape)}, schema says integers {want}"
                    )
            if st.kind in DOCUMENT_KINDS and st.exceptions:
                t = tensors[st.exceptions]
                if t.dim() != len(lead) or tuple(t.shape[:-1]) != lead[:-1]:
                    raise SchemaMismatch(
                        f"stored exceptions {st.exceptions!r} of field {f.name!r} have shape "
                        f"{tuple(t.shape)}, schema says {(*lead[:-1], 'K')}"
                    )
                if dtype_name(t.dtype) != EXCEPTIONS_DTYPE:
                    raise SchemaMismatch(
                        f"stored exceptions {st.exceptions!r} are {dtype_name(t.dtype)}, "
                        f"not {EXCEPTIONS_DTYPE}"
                    )


def _clear(ends: torch.Tensor, exceptions: torch.Tensor) -> torch.Tensor:
    """`ends` with the flat positions in `exceptions` (per leading index, -1 padded) cleared."""
    import torch

    flat = ends.reshape(*exceptions.shape[:-1], -1)
    n = flat.shape[-1]
    index = exceptions.to(torch.int64)
    index = torch.where(index >= 0, index, n)  # padding lands in a spare column
    wide = torch.cat([flat, flat.new_zeros((*flat.shape[:-1], 1))], -1)
    wide.scatter_(-1, index, False)
    return wide[..., :n].reshape(ends.shape)


_CODECS: dict[tuple[FieldSpec, ...], BatchCodec] = {}


def codec_for(schema: Sequence[FieldSpec]) -> BatchCodec:
    """The codec of a schema, made once per process for each schema."""
    key = tuple(schema)
    codec = _CODECS.get(key)
    if codec is None:
        codec = _CODECS[key] = BatchCodec(key)
    return codec


def stack_stored(
    schema: Sequence[FieldSpec] | None, batches: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """One file's stored tensors from batches picked out of other files (each a mapping of a
    batch's stored slices): stacked, with the exceptions lists padded (-1) to the longest."""
    import torch

    if not batches:
        raise ValueError("a batch file needs at least one batch")
    ragged = {f.storage.exceptions for f in schema or () if f.storage.exceptions}
    out: dict[str, torch.Tensor] = {}
    for name in batches[0]:
        parts = [b[name] for b in batches]
        if name in ragged:
            k = max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, k - p.shape[-1]), value=-1) for p in parts]
        out[name] = torch.stack(parts)
    return out
