"""Row 7 on a GPU, per shape: get_batch(device="cuda") against a plain pinned int64
host-to-device copy of the same rows, in the same run.

Per shape, in interleaved repeats (medians reported), all in microseconds per batch:
- get_batch: calls steady inside a file (the next file prefetched, the backlog full),
  back to back, the GPU synchronised only around the whole run of calls;
- transfer: Transfer.deliver alone on stored windows cut from the corpus (not pinned, as
  a mapped file is), without the client and its stream: the staging path's own cost;
- into: Transfer.deliver_into int64 buffers on the device (get_batch(out=...));
- reference: x and y of the same shapes, int64 and already pinned, each copied with
  `.to(device, non_blocking=True)` (what the trainer would do with batches it made
  itself), and for `into` a `copy_` of those into the same device buffers.
The ratio is reference time / our time: 1.0 is as fast as the plain copy, the goal is
>= 0.9. `waits` counts calls that had to wait for the GPU to free a staging slot.
On a CPU (the dry run) every figure is a CPU copy and means nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_data import Shape, Sizes, start_server, windows
from bench.harness import median
from bench.walker import FileWalker

GOAL = 0.9


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_batch_us(elapsed_ns: int, n: int) -> float:
    return elapsed_ns / max(1, n) / 1e3


def _reference(xs: list[Any], ys: list[Any], device: Any, n: int) -> float:
    """µs per batch of copying pinned int64 x and y to `device`."""
    _sync(device)
    began = time.perf_counter_ns()
    for i in range(n):
        xs[i % 2].to(device, non_blocking=True)
        ys[i % 2].to(device, non_blocking=True)
    _sync(device)
    return _per_batch_us(time.perf_counter_ns() - began, n)


def _pinned_pair(shape: Shape, vocab: int, device: Any) -> tuple[list[Any], list[Any]]:
    import torch

    def one() -> Any:
        t = torch.randint(0, vocab, (shape.batch_size, shape.block_size))
        return t.pin_memory() if device.type == "cuda" else t

    return [one(), one()], [one(), one()]


def _client_rows(
    server: Any, shape: Shape, sizes: Sizes, device: Any, repeats: int
) -> dict[str, Any]:
    """get_batch steady in a file against the pinned reference, interleaved per file."""
    from queue_client import QueueClient

    dataset = f"lm_{shape.key}"
    ours: list[float] = []
    ref: list[float] = []
    xs, ys = _pinned_pair(shape, sizes.vocab, device)
    with QueueClient(server.address, dataset, device=str(device)) as client:
        walker = FileWalker(client, "train", sizes.batches_per_file, server, dataset, sizes.backlog)
        for _ in range(repeats):
            walker.open_next()
            walker.settle()
            _sync(device)
            began = time.perf_counter_ns()
            _, n = walker.time_rest_of_file()
            _sync(device)
            ours.append(_per_batch_us(time.perf_counter_ns() - began, n))
            ref.append(_reference(xs, ys, device, n))
    return {"get_batch_us": median(ours), "reference_us": median(ref), "samples": len(ours)}


def _transfer_rows(corpus: Path, shape: Shape, sizes: Sizes, device: Any, repeats: int) -> dict:
    """Transfer.deliver and deliver_into alone, against the pinned reference and copy_."""
    import torch

    from queue_client.format.schema import parse_schema
    from queue_client.format.storage import BatchCodec
    from queue_client.streaming.transfer import StoredBatch, Transfer
    from queue_providers.compact import lm_window_schema

    n = sizes.batches_per_file
    codec = BatchCodec(parse_schema(lm_window_schema(shape.block_size, sizes.vocab)))
    stored = torch.from_numpy(np.ascontiguousarray(windows(corpus, shape, n)))
    batches = [StoredBatch(codec, codec.field_views([w]), [w]) for w in stored.unbind(0)]
    transfer = Transfer(device)
    xs, ys = _pinned_pair(shape, sizes.vocab, device)
    dims = (shape.batch_size, shape.block_size)
    ox = torch.empty(dims, dtype=torch.int64, device=device)
    oy = torch.empty(dims, dtype=torch.int64, device=device)
    for b in batches[:8]:  # the ring and its layouts made before timing
        transfer.deliver(b)
        transfer.deliver_into(b, (ox, oy))
    _sync(device)
    waits_before = transfer.ring.waits if transfer.ring is not None else 0
    got: dict[str, list[float]] = {"transfer": [], "ref": [], "into": [], "copy": []}
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter_ns()
        for b in batches:
            transfer.deliver(b)
        _sync(device)
        got["transfer"].append(_per_batch_us(time.perf_counter_ns() - began, n))
        got["ref"].append(_reference(xs, ys, device, n))
        began = time.perf_counter_ns()
        for b in batches:
            transfer.deliver_into(b, (ox, oy))
        _sync(device)
        got["into"].append(_per_batch_us(time.perf_counter_ns() - began, n))
        began = time.perf_counter_ns()
        for i in range(n):
            ox.copy_(xs[i % 2], non_blocking=True)
            oy.copy_(ys[i % 2], non_blocking=True)
        _sync(device)
        got["copy"].append(_per_batch_us(time.perf_counter_ns() - began, n))
    ring = transfer.ring
    return {
        "transfer_us": median(got["transfer"]),
        "transfer_reference_us": median(got["ref"]),
        "into_us": median(got["into"]),
        "copy_us": median(got["copy"]),
        "waits": (ring.waits - waits_before) if ring is not None else 0,
        "staged_bytes": ring.last_nbytes if ring is not None else 0,
        "served_bytes": 2 * shape.batch_size * shape.block_size * 8,
    }


def run(workdir: Path, corpora: dict[str, Path], sizes: Sizes, device: Any, repeats: int) -> dict:
    """Every shape's figures: {"shapes": [{shape, get_batch_us, reference_us, ratio, ...}]}."""
    server = start_server(workdir, corpora, sizes, mixtures=False)
    rows = []
    try:
        for shape in sizes.shapes:
            row: dict[str, Any] = {"shape": shape.label, "batch_size": shape.batch_size}
            row["block_size"] = shape.block_size
            row.update(_client_rows(server, shape, sizes, device, repeats))
            row.update(_transfer_rows(corpora["lm"], shape, sizes, device, repeats))
            row["ratio"] = row["reference_us"] / row["get_batch_us"]
            row["transfer_ratio"] = row["transfer_reference_us"] / row["transfer_us"]
            row["into_ratio"] = row["copy_us"] / row["into_us"]
            row["met"] = row["ratio"] >= GOAL
            rows.append(row)
    finally:
        server.stop()
    return {"goal": GOAL, "shapes": rows}
