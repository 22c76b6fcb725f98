"""A training run on the GPU fed five ways, side by side in one process: examples/train.py's
GPT at nanoGPT's sizes, bf16 autocast (float32 in the CPU dry run), fused AdamW, the loop of examples/train.py (the next
batch is fetched after the forward is queued, while the GPU runs it).

Feeds, one shared model and optimizer (the step's work does not depend on the tokens):
- synthetic: one batch made on the device once and reused: no data work at all;
- nanogpt: nanoGPT's get_batch (a memmap per call, B random windows stacked as int64,
  pinned, `.to(device, non_blocking=True)`);
- batchqueue: QueueClient(device=...).get_batch on a token_shards dataset;
- batchqueue_fetch_process: the same with fetch_process=True;
- batchqueue_mixture: a mixture of three token_shards sources (x and y of its batches).

Rounds interleave the feeds (the order rotated each round), each running warm-up steps then
timed steps. Per feed: ms per step (wall clock over the timed steps, the GPU synchronised at
both ends), tokens/s, tokens/s against the synthetic feed, the share of the GPU's step spent
between CUDA events recorded just before and just after the data call (the GPU waiting on
data, plus the copy and widening kernels themselves), and the data call's CPU time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu_data import Shape, Sizes, start_server
from bench.harness import median

REPO = Path(__file__).resolve().parent.parent
FEEDS = ("synthetic", "nanogpt", "batchqueue", "batchqueue_fetch_process", "batchqueue_mixture")


def gpt_class() -> Any:
    """TinyGPT from examples/train.py (a plain GPT; the sizes are arguments)."""
    spec = importlib.util.spec_from_file_location("bq_example_train", REPO / "examples/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyGPT


class _WallEvent:
    """A CPU stand-in for a timing CUDA event (the dry run)."""

    def __init__(self) -> None:
        self.at = 0

    def record(self) -> None:
        self.at = time.perf_counter_ns()

    def elapsed_time(self, end: _WallEvent) -> float:
        return (end.at - self.at) / 1e6


def _event_maker(device: Any) -> Callable[[], Any]:
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.Event(enable_timing=True)
    return _WallEvent


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


Batch = tuple[Any, Any]


def nanogpt_feed(train_bin: Path, shape: Shape, device: Any) -> Callable[[], Batch]:
    """nanoGPT's get_batch, as train.py writes it for a CUDA device."""
    import torch

    b, t = shape.batch_size, shape.block_size

    def get() -> Batch:
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - t, (b,))
        x = torch.stack([torch.from_numpy(data[i : i + t].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + t].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
                device, non_blocking=True
            )
        return x.to(device), y.to(device)

    return get


def _feeds(
    stack: contextlib.ExitStack, address: str, corpus: Path, shape: Shape, sizes: Sizes, device: Any
) -> dict[str, Callable[[], Batch]]:
    import torch

    from queue_client import QueueClient

    dims = (shape.batch_size, shape.block_size)
    fixed = (
        torch.randint(0, sizes.vocab, dims, device=device),
        torch.randint(0, sizes.vocab, dims, device=device),
    )
    feeds: dict[str, Callable[[], Batch]] = {
        "synthetic": lambda: fixed,
        "nanogpt": nanogpt_feed(corpus, shape, device),
    }
    for name, dataset, helper in (
        ("batchqueue", f"lm_{shape.key}", False),
        ("batchqueue_fetch_process", f"lm_{shape.key}", True),
        ("batchqueue_mixture", f"mix_{shape.key}", False),
    ):
        client = stack.enter_context(
            QueueClient(address, dataset, device=str(device), fetch_process=helper)
        )
        if name == "batchqueue_mixture":
            feeds[name] = lambda c=client: _xy(c.get_batch("train"))
        else:
            feeds[name] = lambda c=client: c.get_batch("train")
    return feeds


def _xy(batch: Any) -> Batch:
    return batch["x"], batch["y"]


def _steps(
    model: Any, opt: Any, get: Callable[[], Batch], device: Any, warmup: int, steps: int
) -> dict[str, float]:
    """examples/train.py's loop: forward, the next batch, backward, step, loss.item()."""
    import torch

    event = _event_maker(device)
    # bf16 on the GPU, as nanoGPT trains; the CPU dry run keeps float32 (bf16 is slow there).
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    x, y = get()
    marks: list[tuple[Any, Any, Any, Any]] = []
    data_cpu_ns = 0
    began = 0
    for step in range(warmup + steps):
        timed = step >= warmup
        if step == warmup:
            _sync(device)
            began = time.perf_counter_ns()
        e = (event(), event(), event(), event()) if timed else None
        if e:
            e[0].record()
        with autocast:
            loss = model(x, y)
        if e:
            e[1].record()
        t0 = time.perf_counter_ns()
        x, y = get()  # the next batch, while the GPU runs this forward
        if timed:
            data_cpu_ns += time.perf_counter_ns() - t0
        if e:
            e[2].record()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if e:
            e[3].record()
            marks.append(e)
        loss.item()
    _sync(device)
    wall_s = (time.perf_counter_ns() - began) / 1e9
    step_ms = sum(a.elapsed_time(d) for a, _, _, d in marks)
    data_ms = sum(b.elapsed_time(c) for _, b, c, _ in marks)
    return {
        "wall_s": wall_s,
        "gpu_step_ms": step_ms,
        "gpu_data_ms": data_ms,
        "data_cpu_us": data_cpu_ns / max(1, steps) / 1e3,
    }


def run(
    workdir: Path,
    corpora: dict[str, Path],
    sizes: Sizes,
    device: Any,
    *,
    shape: Shape,
    model_sizes: dict[str, int],
    rounds: int,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    """Every feed's figures for one model and shape."""
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = gpt_class()(sizes.vocab, shape.block_size, **model_sizes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda")
    server = start_server(workdir, corpora, sizes, mixtures=True)
    per_feed: dict[str, list[dict[str, float]]] = {name: [] for name in FEEDS}
    try:
        with contextlib.ExitStack() as stack:
            feeds = _feeds(stack, server.address, corpora["lm"], shape, sizes, device)
            # The first steps of a model pay for kernels' first launches and the optimizer's
            # state: taken before any feed is timed.
            _steps(model, opt, feeds["synthetic"], device, warmup, 0)
            for r in range(rounds):
                order = FEEDS[r % len(FEEDS) :] + FEEDS[: r % len(FEEDS)]
                for name in order:
                    per_feed[name].append(_steps(model, opt, feeds[name], device, warmup, steps))
    finally:
        server.stop()
    tokens = shape.batch_size * shape.block_size * steps
    feeds_out = {}
    for name, runs in per_feed.items():
        wall = median([r["wall_s"] for r in runs])
        feeds_out[name] = {
            "ms_per_step": wall / steps * 1e3,
            "tokens_per_s": tokens / wall,
            "data_wait_share": sum(r["gpu_data_ms"] for r in runs)
            / max(1e-9, sum(r["gpu_step_ms"] for r in runs)),
            "data_cpu_us": median([r["data_cpu_us"] for r in runs]),
            "rounds": len(runs),
        }
    base = feeds_out["synthetic"]["tokens_per_s"]
    for figures in feeds_out.values():
        figures["vs_synthetic"] = figures["tokens_per_s"] / base
    params = sum(p.numel() for p in model.parameters())
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return {
        "shape": shape.label,
        "model": {**model_sizes, "vocab": sizes.vocab, "params": params, "dtype": dtype},
        "steps": steps,
        "warmup": warmup,
        "feeds": feeds_out,
    }
