"""The device path end to end on the CPU: a client whose transfer stages every batch through
a ring of CPU buffers (one flat buffer per call, fused widening) reads from a real server
exactly the batches the zero-copy CPU client reads, for a char_lm window, text_lm's derived
fields and a mixture's source field, with and without out=, and across files with a batch
size that changes per call. tests/test_cuda.py runs the same on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.device_batches import DATASETS, cpu_copy, cpu_ring, datasets_config, fields, read

from conftest import ServerFactory, tiny_corpus
from queue_client import QueueClient
from queue_client.streaming.transfer import Transfer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("staging")
    factory = ServerFactory(tmp)
    try:
        yield factory(datasets_config(tmp, tiny_corpus(tmp / "corpus.txt")))
    finally:
        factory.close()


def staged(address: str, dataset: str) -> QueueClient:
    client = QueueClient(address, dataset, device="cpu")
    client._transfer = Transfer("cpu", ring=cpu_ring())
    return client


@pytest.mark.parametrize("dataset", DATASETS)
def test_staged_batches_equal_the_zero_copy_batches(server, dataset: str) -> None:
    with QueueClient(server.address, dataset, device="cpu") as cpu:
        expected = read(cpu, 9)
    with staged(server.address, dataset) as client:
        got = [client.get_batch("train") for _ in range(9)]
        # What would cross the link: the narrow stored bytes, not the served ones.
        served = sum(t.numel() * t.element_size() for t in fields(expected[-1]))
        assert 0 < client._transfer.ring.last_nbytes < served / 2  # type: ignore[union-attr]
    with staged(server.address, dataset) as client:
        first = client.get_batch("train")
        out = cpu_copy(first)
        into = [cpu_copy(first)]
        for _ in range(8):
            client.get_batch("train", out=out)
            into.append(cpu_copy(out))
    for want, a, b in zip(expected, got, into, strict=True):
        for w, x, y in zip(fields(want), fields(a), fields(b), strict=True):
            assert x.dtype == w.dtype == y.dtype and x.is_contiguous()
            assert torch.equal(x, w) and torch.equal(y, w)


def test_a_staged_batch_size_ramp_takes_the_rows_across_files(server) -> None:
    ramp = [2, 2, 4, 4, 8, 8, 16, 16, 3, 5]  # 68 rows of 16-row files
    with QueueClient(server.address, "chars", device="cpu") as cpu:
        want_x, want_y = cpu_copy(cpu.get_batch("train", batch_size=sum(ramp)))
    with staged(server.address, "chars") as client:
        got = [cpu_copy(client.get_batch("train", batch_size=b)) for b in ramp]
    assert torch.equal(torch.cat([x for x, _ in got]), want_x)
    assert torch.equal(torch.cat([y for _, y in got]), want_y)


def test_the_ring_holds_its_slots_across_a_file_switch(server, tmp_path: Path) -> None:
    with staged(server.address, "chars") as client:
        for _ in range(3):
            client.get_batch("train")
        ring = client._transfer.ring
        assert ring is not None
        before = [s.host.data_ptr() for s in ring.slots]
        for _ in range(10):  # past two file switches, same batch shape
            client.get_batch("train")
        assert [s.host.data_ptr() for s in ring.slots] == before
