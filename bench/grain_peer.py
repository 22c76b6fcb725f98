"""The peer of row 15: Grain (pip package `grain`, extra `peers`) making the same batches.

Run as its own process (`python -m bench.grain_peer`), as a trainer using Grain would be:
after the trainer's own imports (numpy, torch) the clock starts, then Grain is imported, a
MapDataset of batches is built whose map draws B random windows of T+1 tokens from train.bin
(int64 x and y, seeded by the batch index), and `mp_prefetch` runs it in 2 worker processes.
It prints one JSON line: seconds to the first batch, the PSS of its worker processes (the
loader's own processes; the part of Grain inside the trainer is not counted), and the sum
of every batch read, so the work cannot be skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np


def pss_mib(pids: list[int]) -> float:
    """Proportional set size of these processes together, from /proc/PID/smaps_rollup."""
    total_kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
                total_kib += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:  # ended meanwhile
            continue
    return total_kib / 1024


def children(pid: int) -> list[int]:
    """Every process descended from `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += parents.get(p, [])
    return found


class Windows:
    """Batch i: B windows of T+1 tokens at random starts drawn from a generator seeded by i."""

    def __init__(self, train_bin: str, batch_size: int, block_size: int) -> None:
        self.train_bin, self.batch_size, self.block_size = train_bin, batch_size, block_size
        self._data: np.memmap | None = None

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if self._data is None:  # opened in each worker process
            self._data = np.memmap(self.train_bin, dtype=np.uint16, mode="r")
        rng = np.random.default_rng(index)
        starts = rng.integers(0, len(self._data) - self.block_size - 1, self.batch_size)
        offsets = np.arange(self.block_size + 1)
        windows = self._data[starts[:, None] + offsets].astype(np.int64)
        return {"x": windows[:, :-1], "y": windows[:, 1:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grain_peer")
    p.add_argument("--train-bin", required=True)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    # The trainer's import, here and not at the top: Grain's spawned workers import this
    # module again, and a pipeline module of its own would not import torch.
    import torch

    began = time.monotonic()
    import grain

    make = Windows(args.train_bin, args.batch_size, args.block_size)
    dataset = (
        grain.MapDataset.range(10**9)
        .map(make)
        .to_iter_dataset()
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers))
    )
    batches = iter(dataset)
    total = 0
    first = next(batches)
    first_s = time.monotonic() - began
    for batch in [first, *(next(batches) for _ in range(args.batches - 1))]:
        total += int(torch.from_numpy(batch["x"]).sum()) + int(torch.from_numpy(batch["y"]).sum())
    workers = children(os.getpid())
    print(
        json.dumps(
            {
                "first_batch_s": first_s,
                "pss_mib": pss_mib(workers),
                "processes": len(workers),
                "trainer_pss_mib": pss_mib([os.getpid()]),
                "sum": total,
            }
        ),
        flush=True,
    )
    # Grain's teardown at interpreter exit is noisy, and its workers would keep stdout open
    # after os._exit: they go first.
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
