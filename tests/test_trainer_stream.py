"""TrainerStream, the part of the framework integrations that needs no framework, against a
real server: the state is that of the batches trained on, a batch handed out and never
trained on comes first in the next iteration, a closed stream reopens where it stood, and
what would lose the stream's place is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import char_config, tiny_corpus
from queue_client import InvalidRequest, QueueClient
from queue_client.integrations.trainer_stream import (
    TrainerStream,
    checkpoint_record,
    every_rank,
    states_of,
)


@pytest.fixture
def server(start_server, tmp_path: Path):
    """ "chars" and "ref": one config, so the same rows, and a stream each."""
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    config = char_config(corpus, batches_per_file=3)
    return start_server(config + char_config(corpus, name="ref", batches_per_file=3, server=None))


def reference(address: str, n: int) -> list[torch.Tensor]:
    with QueueClient(address, "ref", rank=0, world_size=1, copy=True) as client:
        return [client.get_batch("train")[0] for _ in range(n)]


def test_the_state_counts_the_batches_trained_on_and_a_dropped_look_ahead_comes_again(
    server,
) -> None:
    ref = reference(server.address, 8)
    stream = TrainerStream(server.address, "chars", copy=True)
    stream.open(0, 1)
    first = iter(stream)
    got = [next(first)[0] for _ in range(3)]  # a loop that fetched one ahead of two steps
    stream.consumed()
    stream.consumed()
    state = stream.state()
    assert state is not None
    place = {k: state["splits"]["train"][k] for k in ("seq", "offset", "next_seq", "pending")}
    assert place == {"seq": 0, "offset": 2 * 4, "next_seq": 1, "pending": []}
    # A new iteration (the next epoch) hands out the fetched, untrained batch first.
    second = iter(stream)
    got += [next(second)[0] for _ in range(3)]
    for _ in range(3):
        stream.consumed()
    assert all(torch.equal(a, b) for a, b in zip(got, [*ref[:3], *ref[2:5]], strict=True))
    # Closed and opened again, it carries on after the batches trained on.
    stream.close()
    stream.open(0, 1)
    assert torch.equal(next(iter(stream))[0], ref[5])
    stream.close()
    # A checkpoint's record, loaded into a fresh stream before it opens.
    record = checkpoint_record(every_rank(stream.state() or {}))
    again = TrainerStream(server.address, "chars", copy=True)
    again.load(states_of(record, "the test's record"))
    again.open(0, 1)
    assert torch.equal(next(iter(again))[0], ref[5])
    again.close()


def test_as_dict_names_the_fields(server) -> None:
    stream = TrainerStream(server.address, "chars", as_dict=True)
    stream.open(0, 1)
    try:
        assert sorted(next(iter(stream))) == ["x", "y"]
    finally:
        stream.close()


def test_what_would_lose_the_streams_place_is_refused(server) -> None:
    stream = TrainerStream(server.address, "chars")
    with pytest.raises(InvalidRequest, match="is not open"):
        iter(stream).__next__()
    # In a DataLoader worker (spawned: a fork of this threaded test process may crash in the
    # child before it gets that far).
    loader = DataLoader(stream, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(InvalidRequest, match="use num_workers=0"):
        next(iter(loader))
    stream.open(0, 1)
    try:
        with pytest.raises(InvalidRequest, match="consumed\\(\\) with no batch handed out"):
            stream.consumed()
    finally:
        stream.close()
    with pytest.raises(InvalidRequest, match="batch_size must be an int >= 1"):
        TrainerStream(server.address, "chars", batch_size=0)
    for bad, message in [
        ([], "expected a batchqueue loader record of version 1, got 'list'"),
        ({"version": 2, "states": [{}]}, "of version 1, got 2"),
        ({"version": 1, "states": []}, "'states' must be a non-empty list"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            states_of(bad, "ckpt.pt")
