"""CPU time to open a batch file (load_batch_file) and to encode one, in formats 2 and 3.

Opening a file runs in the client's prefetch thread with the GIL held, while the trainer
thread wants the GIL for get_batch: the CPU time of a load is what a file switch can take
from the trainer. The file is a typical char_lm one (100 batches of B=12, T=1024: one uint16
window [100, 12, 1025] and its schema), written once in each format; the loads of the two
alternate. The figure is CPU time of the calling thread (time.thread_time), the minimum of
the repeats (and the median beside it), so other processes on a shared machine count little.

    .venv/bin/python -m bench.batchfile_load [--repeats 200]

It runs on its own, outside `python -m bench`'s rows (BENCHMARKS.md, "Opening a batch file").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from queue_client.format.batchfile import (
    encode_batch_file,
    load_batch_bytes,
    load_batch_file,
    publish_batch_file,
)

NUM_BATCHES, BATCH_SIZE, BLOCK = 100, 12, 1024
VERSIONS = (2, 3)


def char_lm_file() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stored tensors and metadata of a char_lm file, as the provider writes them."""
    window = {"kind": "window", "source": "tokens"}
    schema = [
        {"name": name, "dtype": "int64", "shape": [BLOCK], "role": role,
         "stored_dtype": "uint16", "storage": {**window, "offset": offset}}
        for name, role, offset in (("x", "input", 0), ("y", "target", 1))
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 65, (NUM_BATCHES, BATCH_SIZE, BLOCK + 1), generator=gen)
    metadata = {"dataset": "chars", "split": "train", "batch_size": BATCH_SIZE, "schema": schema}
    return {"tokens": tokens.to(torch.uint16)}, metadata


def cpu_seconds(fn: Callable[[], Any]) -> float:
    began = time.thread_time()
    kept = fn()
    spent = time.thread_time() - began
    del kept  # unmapping the file is not the load's
    return spent


def measure(repeats: int) -> dict[int, dict[str, list[float]]]:
    tensors, metadata = char_lm_file()
    out: dict[int, dict[str, list[float]]] = {v: {} for v in VERSIONS}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for v in VERSIONS:
            encoded = encode_batch_file(seq=0, tensors=tensors, metadata=metadata, version=v)
            published = publish_batch_file(Path(tmp), encoded)
            files[v] = (Path(tmp) / str(published.name), encoded.data)
            out[v]["size"] = [len(encoded.data)]
        for i in range(repeats):
            for v in VERSIONS if i % 2 else VERSIONS[::-1]:
                path, data = files[v]
                times = out[v]
                times.setdefault("load_batch_file", []).append(
                    cpu_seconds(lambda path=path: load_batch_file(path))
                )
                if i % 10 == 0:  # the slower calls, fewer times
                    times.setdefault("load_batch_bytes", []).append(
                        cpu_seconds(lambda data=data: load_batch_bytes(data, "bytes"))
                    )
                    times.setdefault("encode_batch_file", []).append(
                        cpu_seconds(
                            lambda v=v: encode_batch_file(
                                seq=0, tensors=tensors, metadata=metadata, version=v
                            )
                        )
                    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a worker and the prefetch thread run
    figures = measure(args.repeats)
    print(f"file: {NUM_BATCHES} x [{BATCH_SIZE}, {BLOCK + 1}] uint16; CPU ms, min (median)")
    print(f"{'':22}" + "".join(f"{'format ' + str(v):>20}" for v in VERSIONS))
    for what in ("load_batch_file", "load_batch_bytes", "encode_batch_file"):
        cells = []
        for v in VERSIONS:
            t = figures[v][what]
            cells.append(f"{min(t) * 1e3:.3f} ({statistics.median(t) * 1e3:.3f})")
        print(f"{what:22}" + "".join(f"{c:>20}" for c in cells))
    print(f"{'bytes':22}" + "".join(f"{figures[v]['size'][0]:>20,}" for v in VERSIONS))


if __name__ == "__main__":
    main()
