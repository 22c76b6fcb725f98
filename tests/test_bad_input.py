"""Every error a user can cause gets a clear message that names what was wrong."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from conftest import NO_METRICS_LISTEN, ServerFactory, char_config, subprocess_env, tiny_corpus
from queue_client import QueueClient, errors
from queue_client.wire import batchqueue_pb2 as pb


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One server for the checks that leave it as they found it."""
    tmp = tmp_path_factory.mktemp("bad_input")
    factory = ServerFactory(tmp)
    yield factory(char_config(tiny_corpus(tmp / "corpus.txt")))
    factory.close()


def test_unknown_dataset_is_named(server) -> None:
    with pytest.raises(errors.UnknownDataset, match=r"'nope'.*served: \['chars'\]"):
        QueueClient(server.address, "nope")


def test_unknown_split_is_named(server) -> None:
    with (
        QueueClient(server.address, "chars") as client,
        pytest.raises(errors.UnknownSplit, match=r"'test'.*\['train', 'val'\]"),
    ):
        client.get_batch("test")


def test_rank_outside_world_size(server) -> None:
    with pytest.raises(errors.InvalidRequest, match="rank 2 must lie in \\[0, world_size=2\\)"):
        QueueClient(server.address, "chars", rank=2, world_size=2)
    # The server checks too, for clients that are not ours.
    request = pb.AcquireLeaseRequest(
        dataset="chars", split="train", rank=5, world_size=2, client_id="c"
    )
    with pytest.raises(grpc.RpcError) as err:
        server.stub.AcquireLease(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 5" in err.value.details()


def test_seq_of_another_rank_is_refused(server) -> None:
    request = pb.AcquireLeaseRequest(
        dataset="chars", split="train", rank=0, world_size=2, client_id="c", seq=3
    )
    with pytest.raises(grpc.RpcError) as err:
        server.stub.AcquireLease(request, timeout=10)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "belongs to rank 1" in err.value.details()
    )


@pytest.mark.parametrize("name", ["../etc", "/abs", "a/../../b", "..", "x\x00y", ""])
def test_dataset_names_that_leave_the_data_root_are_rejected(server, name: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server.stub.GetMeta(pb.GetMetaRequest(dataset=name), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not allowed" in err.value.details()
    with pytest.raises(errors.InvalidRequest):
        QueueClient(server.address, name)


def test_lease_of_another_client_cannot_be_released(server) -> None:
    lease = server.stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset="chars", split="val", client_id="owner", seq=0), timeout=10
    )
    with pytest.raises(grpc.RpcError) as err:
        server.stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="thief", outcome=pb.CONSUMED),
            timeout=10,
        )
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "another client" in err.value.details()
    )
    assert (server.data_root / lease.path).exists()


def test_unreachable_server_names_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with pytest.raises(errors.ServerUnavailable, match=address):
        QueueClient(address, "chars", reconnect_timeout_s=0.5)


def test_empty_queue_times_out_naming_dataset_split_and_address(
    start_server, tmp_path: Path
) -> None:
    config = """
[datasets.slow]
provider = "bq_test_providers:TinyProvider"
batch_size = 2
batches_per_file = 2
max_backlog_files = 1
"""
    server = start_server(config)
    # Rank 1 of 2 waits for seq 1001; a rank-0 client that holds seq 0 and never reads on
    # keeps the window shut (a rank never heard from would be taken to be where rank 1 is).
    server.stub.AcquireLease(
        pb.AcquireLeaseRequest(
            dataset="slow", split="train", rank=0, world_size=2, client_id="c0", seq=0,
            wait_ms=30_000,
        ),
        timeout=60,
    )  # fmt: skip
    request = pb.AcquireLeaseRequest(
        dataset="slow", split="train", rank=1, world_size=2, client_id="c", seq=1001, wait_ms=200
    )
    with pytest.raises(grpc.RpcError) as err:
        server.stub.AcquireLease(request, timeout=10)
    assert (
        err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        and "slow/train seq 1001" in err.value.details()
    )
    with QueueClient(server.address, "slow", rank=1, world_size=2, timeout_s=0.5) as client:
        client.load_state_dict(
            {
                "version": 1,
                "dataset": "slow",
                "rank": 1,
                "world_size": 2,
                "splits": {"train": {"seq": 2001, "offset": 0, "next_seq": 2003, "pending": []}},
            }
        )
        with pytest.raises(errors.NoBatchReady, match=f"slow/train from {server.address}"):
            client.get_batch("train")


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[server]\nlisten = 'nowhere'\n", "server.listen"),
        ("[server]\nbogus = 1\n", "server.bogus"),
        ("[datasets.d]\nprovider = 'char_lm'\n", "datasets.d.batch_size"),
        ("[datasets.d]\nprovider = 'char_lm'\nbatch_size = 0\n", "datasets.d.batch_size"),
        ("[datasets.d]\nprovider = 'char_lm'\nbatch_size = 4\nmode = 'fast'\n", "datasets.d.mode"),
        (
            "[datasets.d]\nprovider = 'char_lm'\nbatch_size = 4\ncolour = 'red'\n",
            "datasets.d.colour",
        ),
        ("[datasets.d]\nprovider = 'nope'\nbatch_size = 4\n", "provider 'nope'"),
        (
            "[datasets.d]\nprovider = 'char_lm'\nbatch_size = 4\n[datasets.d.args]\nblock_sise = 8\n",
            "block_sise",
        ),
        ("[datasets.'..']\nprovider = 'char_lm'\nbatch_size = 4\n", "'..'"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_malformed_config_names_the_key(tmp_path: Path, toml: str, named: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    proc = subprocess.run(
        [sys.executable, "-m", "queue_server", "--config", str(config), *NO_METRICS_LISTEN],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr
