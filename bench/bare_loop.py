"""The floor of rows 1d/1e and 1k/1l: their tight loop on the same kind of rows with no loader.

Each call slices B rows of uint16 windows (T+1 tokens each) out of one tensor in memory and
widens x and y into int64 tensors of their own: the work of a batchqueue call inside a file,
without the loader's server, workers, background threads or RPCs. What this loop's p99
shows is what the machine alone gives; the loader's rows read against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# The windows' start offsets, fixed so every run reads the same rows.
_SEED = 1234


@dataclass
class _View:
    opens_file: bool


class BareWindows:
    """get_batch and stream_view as a QueueClient serves them, over `files` files of
    `batches_per_file` batches of B windows drawn from `train_bin` (uint16 ids)."""

    def __init__(
        self, train_bin: Path, batch_size: int, block_size: int, batches_per_file: int, files: int
    ) -> None:
        tokens = np.memmap(train_bin, dtype=np.uint16, mode="r")
        if len(tokens) <= block_size + 1:
            raise ValueError(f"{train_bin} holds {len(tokens)} tokens, fewer than one window")
        rows = batch_size * batches_per_file * files
        starts = np.random.default_rng(_SEED).integers(0, len(tokens) - block_size - 1, rows)
        windows = np.stack([tokens[s : s + block_size + 1] for s in starts])
        self.rows = torch.from_numpy(windows)
        self.batch_size = batch_size
        self.rows_per_file = batch_size * batches_per_file
        self.at = 0

    def stream_view(self, split: str) -> _View:
        return _View(opens_file=self.at % self.rows_per_file == 0)

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        r0 = self.at if self.at + self.batch_size <= len(self.rows) else 0
        self.at = r0 + self.batch_size
        window = self.rows[r0 : self.at]
        return window[:, :-1].to(torch.int64), window[:, 1:].to(torch.int64)
