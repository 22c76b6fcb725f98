"""Row 7 (CUDA only): host-to-device bandwidth of get_batch(device="cuda") beside torch's own
pinned-memory copies, in the same run.

get_batch copies the mapped batch into a pinned staging buffer (CPU memcpy), then issues one
non_blocking H2D copy per tensor; the reference copies tensors of the same shapes that already
sit in pinned memory, so the gap is the staging memcpy plus Python. A large pinned copy gives
the link's peak for context. Skipped, with a line saying so, where no CUDA device is present.
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


def _skipped() -> list[Result]:
    return [
        Result(
            "7",
            "H2D: get_batch(device='cuda') via pinned staging",
            None,
            "GB/s",
            note="skipped: no CUDA device",
            skipped=True,
        )
    ]


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    if not available():
        return _skipped()
    import torch

    from queue_client import QueueClient

    server = found["cuda"]
    nb = batches_per_file(settings)
    batch_bytes = 2 * B * T * 8
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
    ]
