"""Writing compact storage from served fields: apart from storage.py, which every batch reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from queue_client.errors import SchemaMismatch
from queue_client.format.schema import (
    DOCUMENT_KINDS,
    LENGTH_MASK,
    NEXT_TOKEN,
    PLAIN,
    WINDOW,
    FieldSpec,
    torch_dtype,
    unsigned_dtype_name,
)
from queue_client.format.storage import EXCEPTIONS_DTYPE

if TYPE_CHECKING:
    import torch

    from queue_client.format.storage import BatchCodec


def encode_stored(codec: BatchCodec, served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored tensors of a whole file of served fields ([num_batches, batch_size,
    *shape] each), checked by reading them back: a field whose values the schema's
    storage cannot hold (an id too big for its stored dtype, a mask that is not the one
    its pad id gives) raises SchemaMismatch naming it, and nothing is written."""
    import torch

    if codec.identity:
        return {n: served[n] for n in codec.stored_names}
    stored: dict[str, torch.Tensor] = {}
    for f in codec.schema:  # plain fields, and the width of every window
        if not f.storage.direct:
            continue
        value = served[f.name]
        name, st = f.stored_name, f.storage
        if st.kind == PLAIN:
            stored[name] = value.to(torch_dtype(f.stored_as)).contiguous()
            continue
        width = st.offset + f.shape[-1]
        have = stored.get(name)
        if have is None or have.shape[-1] < width:
            grown = torch.zeros((*value.shape[:-1], width), dtype=torch_dtype(f.stored_as))
            if have is not None:
                grown[..., : have.shape[-1]] = have
            stored[name] = grown
    for f in codec.schema:  # window slices first, then next tokens where they are not ignored
        st = f.storage
        if st.kind == WINDOW:
            stored[f.stored_name][..., st.offset : st.offset + f.shape[-1]] = served[f.name]
    for f in codec.schema:
        st = f.storage
        if st.kind == NEXT_TOKEN:
            part = stored[f.stored_name][..., st.offset : st.offset + f.shape[-1]]
            value = served[f.name]
            keep = value != st.ignore
            # where() in the served dtype: torch before 2.13 has no where() for uint16.
            part.copy_(torch.where(keep, value, part.to(value.dtype)))
    for f in codec.schema:  # what document kinds read beside the ids
        st = f.storage
        if st.kind not in DOCUMENT_KINDS:
            continue
        if st.lengths and st.lengths not in stored:
            stored[st.lengths] = _lengths(codec, f, served)
        if st.exceptions and st.exceptions not in stored:
            stored[st.exceptions] = _exceptions(codec, f, served, stored)
    stored = {n: stored[n].contiguous() for n in codec.stored_names}
    _check_round_trip(codec, served, stored)
    return stored


def _partner(codec: BatchCodec, f: FieldSpec, kind: str, key: str, what: str) -> FieldSpec:
    """The field of storage `kind` that shares f's storage `key` (its lengths, its
    exceptions): the served field the stored one is derived with."""
    value = getattr(f.storage, key)
    for g in codec.schema:
        if g.storage.kind == kind and getattr(g.storage, key) == value:
            return g
    raise SchemaMismatch(f"field {f.name!r}: stored {key} {value!r} need {what}")


def _lengths(codec: BatchCodec, f: FieldSpec, served: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each row's content length, from the length_mask field that shares the lengths
    (its True positions must be a prefix of the row: the round trip checks that)."""
    import torch

    n = f.shape[-1]
    mask_field = _partner(
        codec,
        f,
        LENGTH_MASK,
        "lengths",
        "a length_mask field that says where each row's content ends",
    )
    mask = served[mask_field.name].to(torch.bool)
    lengths = mask.sum(-1)
    return lengths.to(torch_dtype(unsigned_dtype_name(n)))


def _exceptions(
    codec: BatchCodec,
    f: FieldSpec,
    served: Mapping[str, torch.Tensor],
    stored: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """Per batch, the flat positions where the end-of-document id does not end a document
    (text that spells the end-of-text token), -1 padded to the file's most: [nb, K]."""
    import torch

    lab = _partner(
        codec,
        f,
        NEXT_TOKEN,
        "exceptions",
        "a next_token field whose ignored positions say where documents end",
    )
    ids = served[lab.storage.ids]
    eos = ids == lab.storage.value
    if lab.storage.lengths:
        n = ids.shape[-1]
        lengths = stored[lab.storage.lengths].to(torch.int64)
        eos &= torch.arange(n) < lengths.unsqueeze(-1)
    wrong = (eos & (served[lab.name] != lab.storage.ignore)).reshape(ids.shape[0], -1)
    counts = wrong.sum(-1)
    k = int(counts.max()) if counts.numel() else 0
    out = torch.full((ids.shape[0], k), -1, dtype=torch_dtype(EXCEPTIONS_DTYPE))
    if k:
        batch, pos = wrong.nonzero(as_tuple=True)
        starts = torch.cumsum(counts, 0) - counts
        out[batch, torch.arange(len(batch)) - starts[batch]] = pos.to(out.dtype)
    return out


def _check_round_trip(
    codec: BatchCodec, served: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor]
) -> None:
    import torch

    back = codec.decode(stored)
    for f in codec.schema:
        if not torch.equal(back[f.name], served[f.name]):
            raise SchemaMismatch(
                f"field {f.name!r} does not read back from its storage "
                f"{f.storage.to_dict()} (stored as {f.stored_as or 'nothing'}): "
                "its values do not fit the stored dtype, or differ from what the storage "
                "derives; the provider's meta misdescribes its batches"
            )
