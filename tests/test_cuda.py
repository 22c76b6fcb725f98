"""The CUDA path: pinned staging and non_blocking copies. Runs wherever a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import char_config
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
