"""Ranks advance together: one worker makes the seqs in order, and a rank's files are made
only within its window, so a rank read far ahead of another waits for the other to read. The
answer that times out says so: which rank, its unread seqs, and the seq that unblocks it."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from queue_client import QueueClient
from queue_client.errors import NoBatchReady

CONFIG = "[server]\nlease_ttl_s = 30\n" + textwrap.dedent(
    """
    [datasets.d]
    provider = "bq_test_providers:TinyProvider"
    batch_size = 2
    batches_per_file = 1
    max_backlog_files = 2
    workers = 1
    """
)


def test_a_rank_read_far_ahead_is_told_which_ranks_unread_files_block_it(
    start_server: Any,
) -> None:
    """World size 2, one process: rank 1 reads its first batch (seq 1) and stops while rank 0
    reads seqs 0, 2, 4, 6, 8. Rank 1's window (max_backlog_files 2 + 2 = 4 of its seqs: 1, 3,
    5, 7) is made, and the worker, making seqs in order, stops at seq 9: rank 0's seq 10 never
    comes. The NoBatchReady names rank 1, its unread seqs, seq 1 as the one to read, and that
    ranks must advance together; once rank 1 reads on, rank 0's same call serves seq 10."""
    server = start_server(CONFIG)
    # 8 s a file: far more than a tiny file takes, and what the stalled call waits.
    with (
        QueueClient(server.address, "d", rank=1, world_size=2, timeout_s=60.0) as behind,
        QueueClient(server.address, "d", rank=0, world_size=2, timeout_s=8.0) as ahead,
    ):
        behind.get_batch("train")  # seq 1, still held: rank 1 is heard from, at seq 1
        for _ in range(5):  # seqs 0, 2, 4, 6, 8
            ahead.get_batch("train")
        with pytest.raises(NoBatchReady) as stalled:
            ahead.get_batch("train")
        message = str(stalled.value)
        assert "seq 10 (rank 0)" in message, message
        assert "files are made in seq order, and seq 9 of rank 1 comes first" in message, message
        assert "rank 1 has not read its seqs 1, 3, 5, 7" in message, message
        assert "max_backlog_files 2 + 2" in message, message
        assert "rank 0's seq 10 waits until rank 1 reads seq 1" in message, message
        assert "ranks must advance together" in message, message
        behind.get_batch("train")  # seq 3: seq 1 is released, the window moves
        assert behind.state_dict()["splits"]["train"]["seq"] == 5
        ahead.get_batch("train")  # the stalled call again: seq 10 is made now
        assert ahead.state_dict()["splits"]["train"]["seq"] == 12


def test_a_rank_not_heard_from_yet_does_not_hold_the_others_back(start_server: Any) -> None:
    """Rank 1 has not asked for anything while rank 0 reads ten files: production takes it to
    be where rank 0 is (a resumed job reaches a fresh server rank by rank), so rank 0 never
    waits, and when rank 1 starts at seq 1 its files are made on demand: every seq once."""
    server = start_server(CONFIG)
    seen: list[int] = []
    with QueueClient(server.address, "d", rank=0, world_size=2, timeout_s=60.0) as ahead:
        for _ in range(10):  # seqs 0 .. 18
            seen.append(ahead.state_dict()["splits"].get("train", {"seq": 0})["seq"])
            ahead.get_batch("train")
    with QueueClient(server.address, "d", rank=1, world_size=2, timeout_s=60.0) as behind:
        for _ in range(10):  # seqs 1 .. 19
            seen.append(behind.state_dict()["splits"].get("train", {"seq": 1})["seq"])
            behind.get_batch("train")
    assert sorted(seen) == list(range(20)), seen
