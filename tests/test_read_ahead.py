"""No stall at a file switch: the stream reads ahead as deep as the trainer's pace needs
(readahead.py), within what the server lets a rank hold, and its pool's threads exist before
any switch. Checked against a real server, by conditions, not timings."""

from __future__ import annotations

import threading
from pathlib import Path

from conftest import char_config, wait_until
from queue_client import QueueClient
from queue_client.readahead import ReadAhead, read_ahead_for

B, T = 4, 16


def _lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("queue-client-train-")}


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
        # Every thread of the stream runs before the first switch: a switch never starts
        # one. As many as fetches in flight at the deepest read-ahead, and one for releases.
        client.get_batch("train")
        lane = _lane_threads()
        assert len(lane) == 2 + 1
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
        assert _lane_threads() == lane
        assert not [t for t in threading.enumerate() if t.name.startswith("queue-client_")]
    # A closed stream's threads end (after running what was handed to them).
    assert all(not t.is_alive() for t in lane)
