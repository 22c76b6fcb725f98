"""The CUDA path: a ring of pinned staging slots, one non_blocking copy per call, widening
fused on the device, no wait for the GPU in the call. Runs wherever a GPU is present
(tests/test_staging*.py run the same staging on the CPU everywhere)."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from support.device_batches import DATASETS, cpu_copy, datasets_config, fields, read

from conftest import ROOT, char_config, subprocess_env
from queue_client import QueueClient
from queue_client.format.schema import parse_schema
from queue_client.format.storage import BatchCodec
from queue_client.streaming.transfer import StoredBatch, Transfer
from queue_providers.compact import lm_window_schema

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_cuda_batches_equal_cpu_batches(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batches_per_file=4))
    with QueueClient(server.address, "chars", device="cpu") as cpu:
        expected = [tuple(t.clone() for t in cpu.get_batch("train")) for _ in range(10)]
    # A fresh client starts the same stream again: the same seqs, produced again.
    with QueueClient(server.address, "chars", device="cuda") as gpu:
        got = [gpu.get_batch("train") for _ in range(10)]
        torch.cuda.synchronize()
    for (ex, ey), (gx, gy) in zip(expected, got, strict=True):
        assert gx.is_cuda and gy.is_cuda
        assert torch.equal(gx.cpu(), ex) and torch.equal(gy.cpu(), ey)


def window_batches(n: int, b: int = 3, t: int = 16) -> tuple[list[StoredBatch], list[tuple]]:
    """n stored uint16 windows [b, t+1] as a file holds them (not pinned), and their x, y."""
    codec = BatchCodec(parse_schema(lm_window_schema(t, 300)))
    windows = [((torch.arange(b * (t + 1)) * 7 + i) % 300).view(b, t + 1) for i in range(n)]
    windows = [w.to(torch.uint16) for w in windows]
    batches = [StoredBatch(codec, codec.field_views([w]), [w]) for w in windows]
    return batches, [(w[:, :-1].long(), w[:, 1:].long()) for w in windows]


def test_staging_slots_are_pinned_and_reused() -> None:
    transfer = Transfer("cuda")
    src = [torch.arange(12, dtype=torch.int64).view(3, 4) + i for i in range(6)]
    outs = []
    first: list[int] = []
    for s in src:
        outs.append(transfer([s])[0])
        torch.cuda.synchronize()  # the GPU keeps up: the ring needs no more than its two slots
        if len(outs) == 2:
            first = [buf.data_ptr() for buf in transfer.staging]
    assert all(torch.equal(o.cpu(), s) for o, s in zip(outs, src, strict=True))
    assert len(transfer.staging) == 2 and all(buf.is_pinned() for buf in transfer.staging)
    # Same shapes and dtypes: the two slots' buffers are reused, never allocated again.
    assert [buf.data_ptr() for buf in transfer.staging] == first
    # Smaller batches of another shape (a ramp down, the pieces of a batch across files)
    # fit in the same buffers.
    small = [torch.arange(6, dtype=torch.int64).view(2, 3) + i for i in range(4)]
    got = []
    for s in small:
        got.append(transfer([s])[0])
        torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), s) for o, s in zip(got, small, strict=True))
    assert [buf.data_ptr() for buf in transfer.staging] == first


def test_a_call_never_waits_for_the_gpu() -> None:
    """With the GPU busy (a sleep kernel), as many calls as the ring has slots return at
    once, their copies queued behind the sleep; the next one waits for the oldest slot
    (back-pressure) and is counted. The batches are right once the GPU gets to them."""
    transfer = Transfer("cuda")
    batches, want = window_batches(9)
    ring = transfer.ring
    assert ring is not None
    for _ in range(10):  # calls while the GPU is busy grow the ring to all its slots
        torch.cuda._sleep(100_000_000)
        for b in batches[: ring.max_slots]:
            transfer.deliver(b)
        torch.cuda.synchronize()
        if len(ring.slots) == ring.max_slots:
            break
    assert len(ring.slots) == ring.max_slots, "making a slot waited for the GPU"
    assert ring.waits == 0
    began = time.perf_counter()
    torch.cuda._sleep(1_000_000_000)
    torch.cuda.synchronize()
    sleep_s = time.perf_counter() - began
    torch.cuda._sleep(1_000_000_000)
    began = time.perf_counter()
    got = [transfer.deliver(b) for b in batches[4:8]]
    calls_s = time.perf_counter() - began
    busy = not torch.cuda.current_stream().query()
    assert busy and calls_s < sleep_s / 4, (calls_s, sleep_s)
    got.append(transfer.deliver(batches[8]))  # a fifth batch in flight: waits for a slot
    assert ring.waits == 1
    torch.cuda.synchronize()
    for (x, y), (wx, wy) in zip(got, want[4:], strict=True):
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)


def test_one_host_to_device_copy_and_one_widening_kernel_per_call() -> None:
    from torch.profiler import ProfilerActivity, profile

    transfer = Transfer("cuda")
    batches, want = window_batches(6)
    transfer.deliver(batches[0])  # the ring and the layout made before profiling
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # the profiler's own notes are not this test's subject
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            got = [transfer.deliver(b) for b in batches[1:]]
            torch.cuda.synchronize()
    on_gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not on_gpu:
        pytest.skip("the profiler recorded no GPU activity here (no CUPTI)")
    copies = [n for n in on_gpu if "memcpy" in n.lower()]
    kernels = [n for n in on_gpu if "memcpy" not in n.lower() and "memset" not in n.lower()]
    assert len(copies) == 5 and all("htod" in n.lower() for n in copies), on_gpu
    assert len(kernels) == 5, on_gpu
    for (x, y), (wx, wy) in zip(got, want[1:], strict=True):
        assert torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)


def test_narrow_batches_are_widened_on_the_device(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """Format 2 files: the narrow stored tensors cross the link (one flat pinned buffer per
    call, a fraction of the served bytes), and x/y, text_lm's labels, segment ids and mask
    and a mixture's source are made on the device, equal to the CPU's batches, with
    get_batch(device="cuda") and with CUDA out=."""
    server = start_server(datasets_config(tmp_path, corpus))
    for dataset in DATASETS:
        with QueueClient(server.address, dataset, device="cpu") as cpu:
            expected = read(cpu, 9)
        with QueueClient(server.address, dataset, device="cuda") as gpu:
            got = [gpu.get_batch("train") for _ in range(9)]
            torch.cuda.synchronize()
            ring = gpu._transfer.ring
            served = sum(t.numel() * t.element_size() for t in fields(expected[-1]))
            assert ring is not None and 0 < ring.last_nbytes < served / 2
            assert all(buf.is_pinned() for buf in gpu._transfer.staging)
        with QueueClient(server.address, dataset, device="cuda") as gpu:
            first = gpu.get_batch("train")
            out = (
                tuple(torch.empty_like(t) for t in first)
                if isinstance(first, tuple)
                else {k: torch.empty_like(v) for k, v in first.items()}
            )
            into = [cpu_copy(first)]
            for _ in range(8):
                gpu.get_batch("train", out=out)
                torch.cuda.synchronize()
                into.append(cpu_copy(out))
        for want, a, b in zip(expected, got, into, strict=True):
            for w, x, y in zip(fields(want), fields(a), fields(b), strict=True):
                assert x.is_cuda and x.dtype == w.dtype == y.dtype and x.is_contiguous()
                assert torch.equal(x.cpu(), w) and torch.equal(y, w)


def test_a_batch_size_ramp_on_the_device_takes_the_cpu_rows_across_files(
    start_server, corpus: Path
) -> None:
    """get_batch(batch_size=B) on CUDA: batches that span two or three 4-batch files (and a
    size that changes per call, with and without out=) hold the rows the CPU client reads."""
    server = start_server(char_config(corpus, batch_size=4, batches_per_file=4))
    ramp = [2, 2, 4, 4, 8, 8, 16, 16, 3, 5]  # 68 rows: past four 16-row files
    with QueueClient(server.address, "chars", device="cpu") as cpu:
        want_x, want_y = cpu.get_batch("train", batch_size=sum(ramp))
        want_x, want_y = want_x.clone(), want_y.clone()
    with QueueClient(server.address, "chars", device="cuda") as gpu:
        got = [gpu.get_batch("train", batch_size=b) for b in ramp]
        torch.cuda.synchronize()
    assert all(x.is_cuda and y.is_cuda for x, y in got)
    assert torch.equal(torch.cat([x.cpu() for x, _ in got]), want_x)
    assert torch.equal(torch.cat([y.cpu() for _, y in got]), want_y)
    with QueueClient(server.address, "chars", device="cuda") as gpu:
        x0, y0 = gpu.get_batch("train", batch_size=10)  # rows 0..10, inside the first file
        out = (torch.empty_like(x0), torch.empty_like(y0))
        gpu.get_batch("train", out, batch_size=10)  # rows 10..20: crosses into the second
        torch.cuda.synchronize()
    assert torch.equal(x0.cpu(), want_x[:10]) and torch.equal(out[0].cpu(), want_x[10:20])
    assert torch.equal(out[1].cpu(), want_y[10:20])


@pytest.mark.timeout(300)
def test_the_example_trainer_learns_on_the_device(start_server, corpus: Path) -> None:
    """examples/train.py with --device cuda: batches arrive on the GPU and the loss falls."""
    server = start_server(char_config(corpus, batch_size=8, block_size=32, batches_per_file=6))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--address", server.address, "--dataset", "chars", "--steps", "60", "--eval-every", "30", "--device", "cuda", "--expect-loss-drop", "1.0"],
        capture_output=True, text=True, timeout=240, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 60: train loss" in proc.stdout and "val loss" in proc.stdout
