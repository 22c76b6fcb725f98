"""The files a composer reads and writes: a candidate file, mapped with the token histogram of
each of its batches (written by the split's provider workers), and a served file, made of
batches picked out of candidate files and copied as they are stored."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from queue_client.format.batchfile import (
    BatchFile,
    PublishedFile,
    load_batch_file,
    write_batch_file,
)


@dataclass
class CandidateFile:
    batches: BatchFile
    offsets: np.ndarray
    ids: np.ndarray
    counts: np.ndarray

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> CandidateFile:
        bf = load_batch_file(path)
        try:
            offsets = bf.extras["token_hist_offsets"].numpy()
            ids = bf.extras["token_hist_ids"].numpy().astype(np.int64)
            counts = bf.extras["token_hist_counts"].numpy().astype(np.float64)
        except KeyError:
            raise ValueError(f"{path}: candidate file has no token histograms") from None
        if len(offsets) != bf.metadata["num_batches"] + 1 or (ids.size and ids.max() >= vocab_size):
            raise ValueError(f"{path}: token histograms do not fit {vocab_size} ids")
        return cls(bf, offsets, ids, counts)

    def hist(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return self.ids[lo:hi], self.counts[lo:hi]


def write_served(
    directory: Path,
    seq: int,
    picks: Sequence[tuple[CandidateFile, int]],
    alphas: Sequence[float],
) -> PublishedFile:
    """Publish served file `seq`: each picked (candidate file, batch index) copied out as
    stored, with the alpha each was picked at in its metadata."""
    from queue_client.format.storage import stack_stored  # torch: never in the server process

    first = picks[0][0].batches
    # What the files store, copied as stored (FORMAT.md).
    picked = [{n: t[i] for n, t in cf.batches.stored.items()} for cf, i in picks]
    tensors = stack_stored(first.schema, picked)
    metadata = {key: first.metadata[key] for key in ("dataset", "split", "batch_size", "schema")}
    metadata["curriculum_alphas"] = [round(a, 6) for a in alphas]
    return write_batch_file(
        directory, seq=seq, tensors=tensors, metadata=metadata, version=first.version
    )
