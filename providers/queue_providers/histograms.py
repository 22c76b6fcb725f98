"""The per-batch token histograms a curriculum split's candidate files carry (CSR form,
client/queue_client/format/FORMAT.md), which its composer scores batches by. numpy alone: a worker
that makes its files without torch (char_lm) makes these without it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from queue_client.errors import MetaError

if TYPE_CHECKING:
    import torch

__all__ = ["token_histograms"]


def token_histograms(
    tensors: Mapping[str, torch.Tensor | np.ndarray], field_name: str
) -> dict[str, np.ndarray]:
    """Per-batch sparse token histograms of one field, in CSR form (see FORMAT.md), as numpy
    arrays (a batch file stores them as it stores tensors)."""
    if field_name not in tensors:
        raise MetaError(
            f"histogram field {field_name!r} is not in the batch; fields are {sorted(tensors)}"
        )
    values = tensors[field_name]
    floating = not isinstance(values, np.ndarray) and values.dtype.is_floating_point
    array = values if isinstance(values, np.ndarray) else None if floating else values.numpy()
    if array is None or array.dtype.kind not in "iu":
        raise MetaError(f"histogram field {field_name!r} holds {values.dtype}, not token ids")
    # One numpy bincount per batch, on the ids as stored (narrow): 2-5x faster than widening
    # the file's ids to int64 keys and counting them all at once. A vocabulary too large to
    # count densely per batch is sorted instead. Either way ids come out by batch, then id.
    rows = array.reshape(array.shape[0], -1)
    nb = rows.shape[0]
    span = max(int(rows.max()) + 1, 1) if rows.size else 1  # 1 where every id is padding
    signed = rows.dtype.kind == "i" and rows.size > 0 and int(rows.min()) < 0
    offsets = np.zeros(nb + 1, dtype=np.int64)
    ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    counts: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    dense_count = span <= max(_DENSE_HISTOGRAM_BINS, 8 * rows.shape[1])
    for i, row in enumerate(rows):
        if signed:  # padding labels are not counted
            row = row[row >= 0]
        if dense_count:
            dense = np.bincount(row, minlength=span)
            unique = np.flatnonzero(dense)
            count = dense[unique]
        else:
            unique, count = np.unique(row, return_counts=True)
        ids.append(unique)
        counts.append(count)
        offsets[i + 1] = offsets[i] + len(unique)
    return {
        "token_hist_offsets": offsets,
        "token_hist_ids": np.concatenate(ids).astype(np.int32),
        "token_hist_counts": np.concatenate(counts).astype(np.int32),
    }


# token_histograms counts a batch's ids densely below this span (or 8 per id counted), else sorts
_DENSE_HISTOGRAM_BINS = 1 << 16
