"""The CUDA path: pinned staging and non_blocking copies. Runs wherever a GPU is present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, char_config, subprocess_env
from queue_client import QueueClient

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


def test_staging_buffers_are_pinned_and_reused() -> None:
    from queue_client.transfer import Transfer

    transfer = Transfer("cuda")
    src = [torch.arange(12, dtype=torch.int64).view(3, 4) + i for i in range(6)]
    outs = [transfer([s])[0] for s in src[:2]]
    first = [buf.data_ptr() for slot in transfer.staging for buf in slot]
    outs += [transfer([s])[0] for s in src[2:]]
    torch.cuda.synchronize()
    assert all(
        torch.equal(o.cpu(), s) for o, s in zip(outs, src, strict=True)
    )  # no slot overwritten early
    assert len(transfer.staging) == 2 and all(len(slot) == 1 for slot in transfer.staging)
    assert all(buf.is_pinned() for slot in transfer.staging for buf in slot)
    # Same shapes and dtypes: the two slots' buffers are reused, never allocated again.
    assert [buf.data_ptr() for slot in transfer.staging for buf in slot] == first
    # Smaller batches of another shape (a ramp down, the pieces of a batch across files)
    # fit in the same buffers.
    small = [torch.arange(6, dtype=torch.int64).view(2, 3) + i for i in range(4)]
    got = [transfer([s])[0] for s in small]
    torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), s) for o, s in zip(got, small, strict=True))
    assert [buf.data_ptr() for slot in transfer.staging for buf in slot] == first


def _text_lm_table(corpus: Path) -> str:
    return f"""
[datasets.web]
provider = "text_lm"
batch_size = 2
batches_per_file = 4
[datasets.web.args]
source = "{corpus.as_posix()}"
separator = ""
seq_len = 32
micro_batch_size = 2
eval_take = 4
packing = "bin"
"""


def test_narrow_batches_are_widened_on_the_device(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """Format 2 files: the narrow stored tensors cross the link (the pinned staging buffers
    hold uint16 windows), and x/y, text_lm's labels, segment ids and mask are made on the
    device, equal to the CPU's batches, with get_batch(device="cuda") and with CUDA out=."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"doc {i} " + "word " * (i % 37 + 1) for i in range(200)) + "\n")
    server = start_server(char_config(corpus, batches_per_file=4) + _text_lm_table(docs))
    for dataset in ("chars", "web"):
        with QueueClient(server.address, dataset, device="cpu") as cpu:
            expected = [cpu.get_batch("train") for _ in range(9)]
            expected = [
                tuple(t.clone() for t in b)
                if isinstance(b, tuple)
                else {k: v.clone() for k, v in b.items()}
                for b in expected
            ]
        with QueueClient(server.address, dataset, device="cuda") as gpu:
            got = [gpu.get_batch("train") for _ in range(9)]
            torch.cuda.synchronize()
            staged = [buf for slot in gpu._transfer.staging for buf in slot]
            assert staged and staged[0].dtype == torch.uint16 and staged[0].is_pinned()
        with QueueClient(server.address, dataset, device="cuda") as gpu:
            first = gpu.get_batch("train")
            out = (
                tuple(torch.empty_like(t) for t in first)
                if isinstance(first, tuple)
                else {k: torch.empty_like(v) for k, v in first.items()}
            )
            into = [first]
            for _ in range(8):
                gpu.get_batch("train", out=out)
                torch.cuda.synchronize()
                into.append(
                    tuple(t.clone() for t in out)
                    if isinstance(out, tuple)
                    else {k: v.clone() for k, v in out.items()}
                )
        for want, a, b in zip(expected, got, into, strict=True):
            pairs = (
                zip(want, a, b, strict=True)
                if isinstance(want, tuple)
                else ((want[k], a[k], b[k]) for k in want)
            )
            for w, x, y in pairs:
                assert x.is_cuda and y.is_cuda and x.dtype == w.dtype == y.dtype
                assert torch.equal(x.cpu(), w) and torch.equal(y.cpu(), w)


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
