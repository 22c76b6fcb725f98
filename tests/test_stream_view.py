"""QueueClient.stream_view: the read-only snapshot benchmarks time file boundaries with,
checked call by call against a real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import char_config, wait_until
from queue_client import QueueClient, UnknownSplit
from queue_client.streaming.stream import StreamView

NB = 5  # batches per file


def test_view_follows_the_stream_through_a_file_boundary(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batches_per_file=NB))
    with QueueClient(server.address, "chars", rank=1, world_size=2) as client:
        before = client.stream_view("train")
        assert before == StreamView("train", None, 0, 0, "none") and before.opens_file
        client.get_batch("train")
        first = client.stream_view("train")
        assert (first.seq, first.offset, first.batches_in_file) == (1, 1, NB)
        assert not first.opens_file and first.next_file in ("loading", "ready")
        wait_until(lambda: client.stream_view("train").next_file == "ready", 30, "the prefetch")
        for _ in range(NB - 1):
            client.get_batch("train")
        last = client.stream_view("train")
        assert (last.seq, last.offset, last.opens_file, last.next_file) == (1, NB, True, "ready")
        client.get_batch("train")  # opens rank 1's next file: seq 3 of world size 2
        opened = client.stream_view("train")
        assert (opened.seq, opened.offset, opened.opens_file) == (3, 1, False)
        assert client.stream_view("val") == StreamView("val", None, 0, 0, "none")  # untouched
    assert client.stream_view("train").seq is None  # closed: nothing is held


def test_view_without_prefetch_and_of_an_unknown_split(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, batches_per_file=NB))
    with QueueClient(server.address, "chars", prefetch=False) as client:
        for _ in range(NB):
            client.get_batch("train")
            assert client.stream_view("train").next_file == "none"
        assert client.stream_view("train").opens_file
        with pytest.raises(UnknownSplit, match=r"'test'.*\['train', 'val'\]"):
            client.stream_view("test")


def test_view_is_frozen() -> None:
    view = StreamView("train", 0, 1, NB, "ready")
    with pytest.raises(AttributeError):
        view.offset = 2  # type: ignore[misc]
