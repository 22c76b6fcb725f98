"""token_shards at a terabyte: start-up time and worker memory as for 100 MB.

The terabyte is sparse files (they take no disk; their holes read as zeros, valid ids):
four raw .bin files of 256 GiB and an llm.c shard whose header promises 2**31 - 1 tokens
over a sparse body, beside a real small shard. Each corpus gets its own server, started the
same way; start-up is launch to SERVING, memory the largest resident worker after a batch.
The bound is 10% plus a constant for a loaded machine; bench/token_shards.py has the
plain figures.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import numpy as np
from support.token_files import write_llmc, write_raw

from conftest import ServerFactory, process_tree
from queue_client import QueueClient
from queue_server.process_memory import rss_bytes

T = 64
GIB = 1 << 30


def config(inputs: list[str]) -> str:
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.corpus]
        provider = "token_shards"
        batch_size = 8
        batches_per_file = 4
        [datasets.corpus.args]
        inputs = {inputs!r}
        block_size = {T}
        """
    ).replace("'", '"')


def start_and_measure(
    factory: ServerFactory, data_root: Path, inputs: list[str]
) -> tuple[float, int]:
    began = time.monotonic()
    server = factory(config(inputs), data_root=data_root, timeout_s=180)
    started = time.monotonic() - began
    with QueueClient(server.address, "corpus", timeout_s=120) as client:
        for _ in range(8):
            x, _ = client.get_batch("train")
            assert x.shape == (8, T) and int(x.max()) < 50257
    workers = process_tree(server.pid) - {server.pid}
    rss = max(rss_bytes(pid) for pid in workers)
    server.stop()
    return started, rss


def test_a_terabyte_corpus_starts_and_serves_like_100_mb(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    ids = (np.arange(50_000_000, dtype=np.int64) % 50257).astype(np.uint16)  # 100 MB
    write_raw(small / "train.bin", ids)
    big = tmp_path / "big"
    big.mkdir()
    for i in range(4):
        with open(big / f"part{i}.bin", "wb") as f:
            f.truncate(256 * GIB)
    count = (1 << 31) - 1
    header = write_llmc(big / "fineweb_000.bin", np.zeros(0))
    with open(header, "r+b") as f:
        f.seek(8)
        f.write(np.array([count], dtype="<i4").tobytes())
        f.truncate(1024 + 2 * count)
    write_raw(big / "real.bin", ids[:100_000])
    total = sum(p.stat().st_size for p in big.iterdir())
    assert total >= 1 << 40
    assert sum(p.stat().st_blocks * 512 for p in big.iterdir()) < 1 << 30  # sparse indeed

    factory = ServerFactory(tmp_path)
    try:
        small_s, small_rss = start_and_measure(
            factory, tmp_path / "root-small", [str(small / "train.bin")]
        )
        big_s, big_rss = start_and_measure(factory, tmp_path / "root-big", [str(big / "*.bin")])
    finally:
        factory.close()
    assert big_s <= 1.1 * small_s + 5.0, (big_s, small_s)
    assert big_rss <= 1.1 * small_rss + (32 << 20), (big_rss, small_rss)
    assert os.path.getsize(big / "part0.bin") == 256 * GIB
