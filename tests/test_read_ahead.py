"""No stall at a file switch: the stream reads ahead as deep as the trainer's pace needs
(readahead.py), its pool's threads exist before any switch, and zero-copy CPU batches are
widened a few at a time ahead of the trainer (widen.py), as views of memory never written
twice. Checked against a real server, by conditions, not timings."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from conftest import char_config, wait_until
from queue_client import QueueClient
from queue_client.readahead import ReadAhead, read_ahead_for
from queue_client.widen import CHUNK_BATCHES

B, T = 4, 16


def test_depth_grows_with_a_trainer_faster_than_a_fetch_and_never_past_its_cap() -> None:
    ahead = ReadAhead(2, 4)
    assert ahead.read(0.001) == 2  # no fetch measured yet: nothing to judge by
    ahead.fetched(0.010)
    assert ahead.read(1.0) == 2  # a file read slower than a fetch: the floor is enough
    assert ahead.read(0.004) == 4  # 10 ms fetches, a file read in 4 ms: ceil(2.5) + 1
    ahead.fetched(0.001)
    assert ahead.read(1.0) == 4  # never shrinks
    deep = ReadAhead(2, 16)
    deep.fetched(0.010)
    assert deep.read(0.005) == 3 and deep.read(0.0001) == 16
    off = read_ahead_for(0)  # prefetch off: nothing is read ahead, ever
    off.fetched(1.0)
    assert (off.read(0.0), off.cap) == (0, 0)
    assert (read_ahead_for(2).floor, read_ahead_for(2).cap, read_ahead_for(12).cap) == (2, 4, 16)
    # No deeper than the server lets a rank hold ahead (max_backlog_files + 1), nor below
    # prefetch_files, which the trainer chose.
    assert (read_ahead_for(2, 3).cap, read_ahead_for(2, 1).cap, read_ahead_for(2, 0).cap) == (
        3,
        2,
        2,
    )


def test_a_fast_reader_gets_the_next_files_loaded_before_its_file_ends(
    start_server, corpus: Path
) -> None:
    server = start_server(
        char_config(corpus, batch_size=B, block_size=T, extra="max_backlog_files = 8")
    )
    server.wait_ready_files("chars", 8)
    with QueueClient(server.address, "chars", prefetch_files=1) as client:
        # Every thread of the pool runs before the first switch: a switch never starts one.
        client.get_batch("train")
        pool = [t for t in threading.enumerate() if t.name.startswith("queue-client_")]
        assert len(pool) == 4 * 1 + 2
        assert client.stream_view("train").read_ahead == 1
        assert client._streams["train"].read_ahead.cap == 2  # the server allows 8 + 1
        # Five files read back to back: a file of 5 tiny batches takes far less than a lease,
        # crc32 and load of the next, so the stream deepens to its cap of 2.
        for _ in range(5 * 5):
            client.get_batch("train")
        assert client.stream_view("train").read_ahead == 2
        # Both files ahead get loaded while the current one still has rows to serve.
        wait_until(
            lambda: client.stream_view("train").ready_ahead == 2, 60, "two files loaded ahead"
        )
        view = client.stream_view("train")
        assert view.row < view.rows_in_file and view.next_file == "ready"
        assert server.split_stats("chars")["leased_files"] >= 3
        assert len([t for t in threading.enumerate() if t.name.startswith("queue-client_")]) == 6


def test_zero_copy_batches_are_views_of_rows_widened_ahead_and_stay_intact(
    start_server, corpus: Path
) -> None:
    nb = 2 * CHUNK_BATCHES  # two chunks per file
    server = start_server(char_config(corpus, batch_size=B, block_size=T, batches_per_file=nb))
    with QueueClient(server.address, "chars") as client:
        x0, _ = client.get_batch("train")
        stream = client._streams["train"]
        cur = stream.current
        assert cur is not None and cur.chunks is not None
        # The trainer is in chunk 0; the widener fills chunk 1 ahead of it, unasked.
        wait_until(lambda: cur.chunks[1] is not None, 60, "chunk 1 widened ahead")
        chunk = cur.chunks[1]
        for _ in range(CHUNK_BATCHES - 1):
            client.get_batch("train")
        r0 = CHUNK_BATCHES * B
        expected = cur.views(r0, r0 + B)  # the same rows, widened now from the file
        x, y = client.get_batch("train")
        assert x.untyped_storage().data_ptr() == chunk[0].untyped_storage().data_ptr()
        assert x.dtype == y.dtype == torch.int64 and x.shape == (B, T)
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
        assert torch.equal(x[:, 1:], y[:, :-1])  # char windows: y is x shifted by one
        # Batches kept across several files (autograd would) are never written again.
        kept = [(x, x.clone()), (x0, x0.clone())]
        for _ in range(3 * nb):
            client.get_batch("train")
        assert all(torch.equal(t, copy) for t, copy in kept)
        assert cur.chunks is None  # the finished file's widened rows are let go
