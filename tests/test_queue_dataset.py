"""QueueDataset under a DataLoader: the client's stream, state_dict passed through, and a
disjoint stream per DataLoader worker, against a real server."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import char_config, run_client_script
from queue_client import QueueClient
from queue_client.dataset import QueueDataset, worker_world
from queue_client.errors import InvalidRequest
from queue_client.world import World


def xs(loader: DataLoader) -> list[torch.Tensor]:
    return [x.clone() for x, _ in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 1), (1, 3), (2, 2), (3, 2)])
def test_worker_streams_partition_the_trainer_ranks(world_size: int, num_workers: int) -> None:
    """Every (trainer rank, worker) gets its own stream; together they are every stream once."""
    streams = [
        worker_world(World(r, world_size), i, num_workers)
        for r in range(world_size)
        for i in range(num_workers)
    ]
    assert {s.world_size for s in streams} == {world_size * num_workers}
    assert sorted(s.rank for s in streams) == list(range(world_size * num_workers))
    with pytest.raises(ValueError, match="worker_id 2"):
        worker_world(World(0, 1), 2, 2)


def test_main_process_loader_is_the_clients_stream_and_resumes(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus))
    with QueueClient(server.address, "chars") as client:
        reference = [client.get_batch("train")[0].clone() for _ in range(14)]

    ds = QueueDataset(server.address, "chars", "train", max_batches=7)
    loader = DataLoader(ds, batch_size=None)
    first = xs(loader)
    state = ds.state_dict()
    assert state["splits"]["train"] == {
        "seq": 1,
        "offset": 2 * ds.client().file_batch_size,
        "next_seq": 2,
        "pending": [],
        "step": 7,
    }  # 7 batches of 5 per file; the offset counts rows; 7 steps served
    rest = xs(loader)  # iterating again continues the stream
    assert same(first + rest, reference)
    # The dataset pickles without its live client (as a DataLoader with workers pickles it):
    # the copy keeps its settings, but has read nothing, so it has no position to give.
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.max_batches == 7 and repr(copy) == repr(ds)
    with pytest.raises(InvalidRequest, match="has read nothing in this process"):
        copy.state_dict()

    ds.load_state_dict(state)  # passed to the live client
    assert same(xs(loader), rest)
    ds.close()
    assert server.split_stats("chars")["leased_files"] == 0  # close() gave the leases back

    resumed = QueueDataset(server.address, "chars", "train", max_batches=7)
    resumed.load_state_dict(state)  # kept until the client is created in __iter__
    assert resumed.state_dict() == state
    with resumed:
        assert same(xs(DataLoader(resumed, batch_size=None)), rest)


def test_dataloader_workers_read_disjoint_streams(start_server, corpus: Path) -> None:
    """Trainer rank 1 of 2 with 2 workers: the workers read streams 2 and 3 of 4."""
    server = start_server(char_config(corpus))
    out = run_client_script(
        f"""
        import hashlib, json
        import torch
        from torch.utils.data import DataLoader
        from queue_client.dataset import QueueDataset

        ds = QueueDataset("{server.address}", "chars", "train", rank=1, world_size=2, max_batches=10)
        batches = [x for x, _ in DataLoader(ds, batch_size=None, num_workers=2)]
        assert all(x.shape == (4, 16) for x in batches)
        # Copied out of the file in the workers: each batch owns its memory.
        assert all(x.untyped_storage().nbytes() == x.nbytes for x in batches)
        print(json.dumps([hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in batches]))
        """
    )
    fingerprints = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(fingerprints) == 20 and len(set(fingerprints)) == 20
    train = server.split_stats("chars")
    assert train["world_size"] == 4
    # Each worker read 2 files of its own stream (seqs 2, 6 and 3, 7), and gave its leases back
    # when the DataLoader shut it down.
    assert [(int(r["rank"]), int(r["last_consumed_seq"])) for r in train["ranks"]] == [
        (0, -1),
        (1, -1),
        (2, 6),
        (3, 7),
    ]
    assert train["leased_files"] == 0 and train["consumed_files"] == 4


def test_device_is_refused_with_a_reason() -> None:
    with pytest.raises(TypeError, match="CPU batches"):
        QueueDataset("127.0.0.1:1", "chars", device="cuda")
