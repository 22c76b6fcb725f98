"""Where a batch file's rows came from, said by the arithmetic that makes the file.

`queue-client explain` (docs/ordering.md, "Explaining a step") asks a provider for rows of
one file: DataProviderBase.provenance(split, seq, rows) answers one dict per row, with these
keys, never reading the corpus (a provider places a file's windows from its seeds, or its
epoch order, before it reads a token):

- file: the input file (shard) the row's tokens are read from;
- token_offset: the index in that file's token array of the row's first token (x[0]);
- document: the index, among that file's documents, of the document holding that token,
  where the file records documents (a prepared corpus, a Megatron index); -1 where it does
  not, or where the token lies before the file's first document start;
- source: the mixture source the row was drawn from ("" outside a mixture).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROW_KEYS = ("source", "file", "token_offset", "document")


def check_rows(rows: Sequence[int], per_file: int, where: str) -> np.ndarray:
    """`rows` as int64, each in [0, per_file), or ValueError naming the first one outside."""
    out = np.asarray(rows, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((out < 0) | (out >= per_file))
    if bad.size:
        raise ValueError(
            f"{where}: row {int(out[bad[0]])} is outside the file's {per_file} rows [0, {per_file})"
        )
    return out


def documents_at(starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The document holding each token offset, given the sorted document starts (a
    searchsorted: no token read); -1 before the first start."""
    return np.searchsorted(starts, offsets, side="right") - 1


def window_rows(
    files: Sequence[str],
    doc_starts: Sequence[Callable[[], np.ndarray] | None],
    file_index: np.ndarray,
    offsets: np.ndarray,
) -> list[dict[str, Any]]:
    """One provenance dict per row that reads file `file_index[i]` (of `files`, whose
    document starts `doc_starts` loads, None where unknown) from token `offsets[i]`."""
    documents = np.full(len(offsets), -1, dtype=np.int64)
    for index in np.unique(file_index).tolist():
        load = doc_starts[index]
        if load is not None:
            at = file_index == index
            documents[at] = documents_at(np.asarray(load(), dtype=np.int64), offsets[at])
    return [
        {"source": "", "file": files[f], "token_offset": int(o), "document": int(d)}
        for f, o, d in zip(file_index.tolist(), offsets.tolist(), documents.tolist(), strict=True)
    ]
