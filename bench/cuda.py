"""Row 7 (CUDA only): host-to-device bandwidth of get_batch(device="cuda") beside torch's own
pinned-memory copies, in the same run.

7a: get_batch copies the mapped batch as stored (one uint16 window of T+1 ids per row, not
two int64 tensors) into a pinned staging buffer (CPU memcpy), issues one non_blocking H2D copy
of those narrow bytes, and widens x and y on the device; the reference copies int64 tensors
of the served shapes that already sit in pinned memory. 7b is the same path without the
server: Transfer.deliver_into(out=device buffers) of a stored window against a plain pinned
`copy_` of the served int64 tensors into the same buffers. Both count served bytes (what the
trainer gets), so moving a quarter of them over the link can beat the plain copy. A large
pinned copy gives the link's peak for context. Skipped, with a line saying so, where no CUDA
device is present.
"""

from __future__ import annotations

import time

from bench.data import Tokens
from bench.harness import Result, Settings, median
from bench.servers import Server, ServerSpec, dataset_toml
from bench.walker import FileWalker

B, T = 12, 1024
BACKLOG = 2
_PEAK_BYTES = 256 * 2**20


def available() -> bool:
    import torch

    return torch.cuda.is_available()


def batches_per_file(settings: Settings) -> int:
    return settings.pick(100, 8)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    if not available():
        return []
    return [
        ServerSpec(
            "cuda",
            (
                dataset_toml(
                    "cuda",
                    text=tokens.text_path,
                    batch_size=B,
                    block_size=T,
                    batches_per_file=batches_per_file(settings),
                    backlog=BACKLOG,
                ),
            ),
        )
    ]


NARROW_GOAL = 0.9


def _skipped() -> list[Result]:
    return [
        Result(
            "7",
            "H2D: get_batch(device='cuda') via pinned staging",
            None,
            "GB/s",
            note="skipped: no CUDA device",
            skipped=True,
        ),
        Result(
            "7",
            "H2D: narrow window + widen on device, into out= buffers",
            None,
            "GB/s",
            note="skipped: no CUDA device",
            skipped=True,
        ),
    ]


def _narrow_into(settings: Settings, n: int) -> tuple[float, float]:
    """(GB/s of served bytes) for Transfer.deliver_into of a uint16 window [B, T+1] into int64
    device buffers, and for a plain pinned copy_ of int64 [B, T] x and y into the same."""
    import torch

    from queue_client.format.schema import parse_schema
    from queue_client.format.storage import BatchCodec
    from queue_client.streaming.transfer import StoredBatch, Transfer
    from queue_providers.compact import lm_window_schema

    codec = BatchCodec(parse_schema(lm_window_schema(T, 65)))
    windows = torch.randint(0, 65, (n, B, T + 1)).to(torch.uint16)  # as mapped: not pinned
    batches = [StoredBatch(codec, codec.field_views([w]), [w]) for w in windows.unbind(0)]
    xs = [w[:, :-1].to(torch.int64).pin_memory() for w in windows.unbind(0)]
    ys = [w[:, 1:].to(torch.int64).pin_memory() for w in windows.unbind(0)]
    ox = torch.empty(B, T, dtype=torch.int64, device="cuda")
    oy = torch.empty(B, T, dtype=torch.int64, device="cuda")
    transfer = Transfer("cuda")
    served = 2 * B * T * 8
    ours: list[float] = []
    plain: list[float] = []
    for _ in range(settings.repeats):
        torch.cuda.synchronize()
        began = time.perf_counter_ns()
        for batch in batches:
            transfer.deliver_into(batch, (ox, oy))
        torch.cuda.synchronize()
        ours.append(n * served / (time.perf_counter_ns() - began))
        began = time.perf_counter_ns()
        for x, y in zip(xs, ys, strict=True):
            ox.copy_(x, non_blocking=True)
            oy.copy_(y, non_blocking=True)
        torch.cuda.synchronize()
        plain.append(n * served / (time.perf_counter_ns() - began))
    return median(ours), median(plain)


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    if not available():
        return _skipped()
    import torch

    from queue_client import QueueClient

    server = found["cuda"]
    nb = batches_per_file(settings)
    batch_bytes = 2 * B * T * 8  # served bytes: what the trainer gets
    src = [torch.randint(0, 65, (B, T)).pin_memory() for _ in range(2)]
    big = torch.empty(_PEAK_BYTES, dtype=torch.uint8).pin_memory()
    big_dev = torch.empty(_PEAK_BYTES, dtype=torch.uint8, device="cuda")
    gb_s: dict[str, list[float]] = {"get_batch": [], "pinned": [], "peak": []}
    with QueueClient(server.address, "cuda", rank=0, world_size=1, device="cuda") as client:
        walker = FileWalker(client, "train", nb, server, "cuda", BACKLOG)
        for _ in range(settings.repeats):
            walker.open_next()
            walker.settle()
            torch.cuda.synchronize()
            began = time.perf_counter_ns()
            _, n = walker.time_rest_of_file()
            torch.cuda.synchronize()
            gb_s["get_batch"].append(n * batch_bytes / (time.perf_counter_ns() - began))

            torch.cuda.synchronize()
            began = time.perf_counter_ns()
            for _ in range(n):
                for s in src:
                    s.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            gb_s["pinned"].append(n * batch_bytes / (time.perf_counter_ns() - began))

            began = time.perf_counter_ns()
            big_dev.copy_(big, non_blocking=True)
            torch.cuda.synchronize()
            gb_s["peak"].append(_PEAK_BYTES / (time.perf_counter_ns() - began))
    got, ref, peak = (median(gb_s[k]) for k in ("get_batch", "pinned", "peak"))
    name = torch.cuda.get_device_name()
    narrow, plain = _narrow_into(settings, nb)
    return [
        Result(
            "7",
            f"H2D: get_batch(device='cuda') B={B} T={T}, steady in a file",
            got,
            "GB/s",
            "pinned .to(cuda), same shapes",
            ref,
            "GB/s",
            got / ref,
            "x pinned",
            "info",
            None,
            f"{name}; a {_PEAK_BYTES // 2**20} MiB pinned copy runs at {peak:.1f} GB/s",
        ),
        Result(
            "7",
            f"H2D: narrow window + widen on device, into out= buffers, B={B} T={T}",
            narrow,
            "GB/s",
            "plain pinned copy_ of int64 x, y",
            plain,
            "GB/s",
            narrow / plain,
            "x pinned",
            f">= {NARROW_GOAL:g}x",
            narrow / plain >= NARROW_GOAL,
            "GB/s of served (int64) bytes; the link carries uint16 [B, T+1] per batch",
        ),
    ]
