"""No stall at a file switch: the stream reads ahead as deep as the trainer's pace needs
(readahead.py), within what the server lets a rank hold; its threads exist before any switch,
and a switch hands out a batch widened ahead. Checked against a real server, by conditions,
not timings."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from conftest import char_config, wait_until
from queue_client import QueueClient
from queue_client.streaming.readahead import ReadAhead, read_ahead_for

B, T = 4, 16


def _lane_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """The train stream's threads started since `before` (not another test's client's)."""
    return {
        t for t in set(threading.enumerate()) - before if t.name.startswith("queue-client-train-")
    }


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
    assert (read_ahead_for(2).floor, read_ahead_for(2).cap, read_ahead_for(5).cap) == (2, 8, 16)
    # Streamed files (transport "grpc") are held in the client's memory: half as deep.
    assert read_ahead_for(2, in_memory=True).cap == 4
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
    before = set(threading.enumerate())
    with QueueClient(server.address, "chars", prefetch_files=1) as client:
        # Every thread of the stream runs before the first switch: a switch never starts
        # one. As many as fetches in flight at the deepest read-ahead, and three for releases.
        client.get_batch("train")
        lane = _lane_threads(before)
        assert len(lane) == 4 + 3
        assert client.stream_view("train").read_ahead == 1
        assert client._streams["train"].read_ahead.cap == 4  # the server allows 8 + 1
        # Five files read back to back: a file of 5 tiny batches takes far less than a lease,
        # crc32 and load of the next, so the stream deepens to its cap of 4.
        for _ in range(5 * 5):
            client.get_batch("train")
        assert client.stream_view("train").read_ahead == 4
        # Every file ahead gets loaded while the current one still has rows to serve.
        wait_until(
            lambda: client.stream_view("train").ready_ahead == 4, 60, "four files loaded ahead"
        )
        view = client.stream_view("train")
        assert view.row < view.rows_in_file and view.next_file == "ready"
        assert server.split_stats("chars")["leased_files"] >= 5
        assert _lane_threads(before) == lane
        assert not [t for t in threading.enumerate() if t.name.startswith("queue-client_")]
    # A closed stream's threads end (after running what was handed to them).
    assert all(not t.is_alive() for t in lane)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_background_threads_never_preempt_the_trainer_on_wakeup(
    start_server, corpus: Path
) -> None:
    """The stream's threads run as SCHED_BATCH (a woken one waits for a free core or the
    scheduler's next turn); the trainer's thread keeps the policy it had."""
    server = start_server(char_config(corpus, batch_size=B, block_size=T))
    before = set(threading.enumerate())
    mine = os.sched_getscheduler(0)
    with QueueClient(server.address, "chars") as client:
        client.get_batch("train")
        lane = _lane_threads(before)
        assert lane
        assert {os.sched_getscheduler(t.native_id) for t in lane} == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == mine != os.SCHED_BATCH


def test_a_switch_hands_out_the_batch_widened_ahead_and_releases_without_another_call(
    start_server, corpus: Path
) -> None:
    """The call that opens a file hands out its first batch as the background widened it
    (the trainer owns those tensors: they are never handed out again); the finished file's
    release reaches the server with no further call; and closing the stream (here through
    load_state_dict) returns only once every release handed to the background is done."""
    server = start_server(
        char_config(
            corpus, batch_size=B, block_size=T, batches_per_file=3, extra="max_backlog_files = 6"
        )
    )
    server.wait_ready_files("chars", 6)
    with QueueClient(server.address, "chars", prefetch_files=2) as client:
        for _ in range(3):  # the first file, whose switch has no batch widened ahead
            client.get_batch("train")
        stream = client._streams["train"]
        job, _ = stream._pending[0]
        nxt = job.result(timeout=60)
        wait_until(lambda: nxt.first is not None, 60, "the next file's first batch widened")
        assert nxt.first is not None
        r0, r1, ready = nxt.first
        assert (r0, r1) == (0, B)
        x, y = client.get_batch("train")  # the switch
        assert x is ready[0] and y is ready[1] and nxt.first is None
        expected = nxt.views(0, B)
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
        assert x.dtype == torch.int64 and x.is_contiguous() and x.shape == (B, T)
        # The first file goes back as consumed without another get_batch.
        wait_until(lambda: server.split_stats("chars")["consumed_files"] == 1, 60, "a release")
        for _ in range(3 * 2):  # the rest of that file and the next; the last call switches
            client.get_batch("train")
        # Closed right after a switch, while its release is in flight: no wait, the close
        # behind load_state_dict ran every release handed over before it returned.
        client.load_state_dict(client.state_dict())
        stats = server.split_stats("chars")
        assert stats["leased_files"] == 0
        assert stats["consumed_files"] == 3


def test_streamed_files_are_read_ahead_half_as_deep_as_mapped_ones(
    start_server, corpus: Path
) -> None:
    """A file read ahead from the data root is mapped page cache; one streamed over gRPC is
    the client's own memory, so a fast trainer's read-ahead grows half as deep there."""
    server = start_server(
        char_config(corpus, batch_size=B, block_size=T, extra="max_backlog_files = 12")
    )
    caps = {}
    for transport in ("file", "grpc"):
        with QueueClient(server.address, "chars", transport=transport) as client:
            client.get_batch("train")
            caps[transport] = client._streams["train"].read_ahead.cap
    assert caps == {"file": 8, "grpc": 4}
