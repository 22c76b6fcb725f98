"""What a user would pick instead of batchqueue, written the way each is usually written.

- nanoGPT's get_batch (train.py, CPU): opens `np.memmap` on every call (nanoGPT does so on
  purpose, to dodge a memmap leak), draws B random starts and stacks B int64 windows for x and
  B for y.
- A torch DataLoader over a map-style dataset of windows (item i = the window starting at
  token i), shuffled, default collate, `num_workers` worker processes kept alive between
  epochs (`persistent_workers=True`).

Both read the same train.bin as the provider reads (see data.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def nanogpt_get_batch(
    train_bin: Path, batch_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's recipe: a fresh memmap per call, then per-window int64 conversion and a stack."""
    data = np.memmap(train_bin, dtype=np.uint16, mode="r")
    starts = torch.randint(len(data) - block_size, (batch_size,))
    xs, ys = [], []
    for i in starts:
        xs.append(torch.from_numpy(data[i : i + block_size].astype(np.int64)))
        ys.append(torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)))
    return torch.stack(xs), torch.stack(ys)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: tokens [i, i+T) as x and [i+1, i+T+1) as y. The memmap opens lazily in each
    worker process, as a DataLoader user would write it."""

    def __init__(self, train_bin: Path, block_size: int) -> None:
        self.path = Path(train_bin)
        self.block_size = block_size
        self._n = self.path.stat().st_size // np.dtype(np.uint16).itemsize
        self._data: np.memmap | None = None

    def __len__(self) -> int:
        return self._n - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = torch.from_numpy(self._data[i : i + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def dataloader_batches(
    train_bin: Path, batch_size: int, block_size: int, workers: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless iterator of batches from one persistent DataLoader; it starts its workers."""
    loader = DataLoader(
        Windows(train_bin, block_size),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )

    def forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    return forever()
