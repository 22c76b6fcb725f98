"""A reader's next lease carries the release of the file it finished: one RPC per file.

The server releases what an AcquireLease carries before it leases (each as ReleaseLease would,
a failed one left to the client), says so in every lease (`carries_releases`), and answers a
second release of a lease by the same client as done, so a client unsure whether a call got
through can always send the release again. The client carries releases only once a lease of
its server said so, and sends them one by one otherwise.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from conftest import ServerFactory, char_config, tiny_corpus, wait_until
from queue_client import QueueClient
from queue_client.wire import batchqueue_pb2 as pb

BATCHES_PER_FILE = 5
DATASETS = ("carry", "failing", "checked", "refused", "stream", "oldwire", "cancel")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    corpus = tiny_corpus(tmp_path_factory.mktemp("carry_corpus") / "corpus.txt")
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        char_config(
            corpus,
            name=name,
            batches_per_file=BATCHES_PER_FILE,
            extra="max_backlog_files = 2",
            server=None,
        )
        for name in DATASETS
    )
    factory = ServerFactory(tmp_path_factory.mktemp("carry"))
    yield factory(config)
    factory.close()


def _lease(server: Any, dataset: str, seq: int, client: str = "c1", **kw: Any) -> pb.Lease:
    request = pb.AcquireLeaseRequest(
        dataset=dataset, split="train", client_id=client, seq=seq, **kw
    )
    return server.stub.AcquireLease(request, timeout=30)


def _release(lease: pb.Lease, client: str = "c1") -> pb.ReleaseLeaseRequest:
    return pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=client, outcome=pb.CONSUMED)


def _held(server: Any, lease: pb.Lease, client: str = "c1") -> bool:
    reply = server.stub.RenewLeases(
        pb.RenewLeasesRequest(client_id=client, lease_ids=[lease.lease_id]), timeout=10
    )
    return lease.lease_id not in reply.lost_lease_ids


def test_a_lease_call_releases_what_it_carries(server: Any) -> None:
    first = _lease(server, "carry", 0)
    assert first.carries_releases  # every lease says so, the first one included
    consumed = server.split_stats("carry")["consumed_files"]
    second = _lease(server, "carry", 1, releases=[_release(first)])
    assert list(second.released) == [first.lease_id]
    assert not _held(server, first) and _held(server, second)
    assert server.split_stats("carry")["consumed_files"] == consumed + 1
    wait_until(
        lambda: not (server.data_root / first.path).exists(), what="the consumed file deleted"
    )
    # Released again by its client (unsure whether that call got through): done, no change.
    server.stub.ReleaseLease(_release(first), timeout=10)
    third = _lease(server, "carry", 2, releases=[_release(first), _release(second)])
    assert set(third.released) == {first.lease_id, second.lease_id}
    assert server.split_stats("carry")["consumed_files"] == consumed + 2


def test_a_carried_release_that_fails_is_left_to_the_client(server: Any) -> None:
    pair = {"world_size": 2}
    mine = _lease(server, "failing", 0, **pair)
    theirs = _lease(server, "failing", 1, client="c2", rank=1, **pair)
    unknown = pb.ReleaseLeaseRequest(lease_id="0" * 32, client_id="c1", outcome=pb.CONSUMED)
    # c2's lease named in c1's request: not c1's to release, so it stays held.
    stolen = pb.ReleaseLeaseRequest(lease_id=theirs.lease_id, client_id="c1", outcome=pb.CONSUMED)
    reply = _lease(server, "failing", 2, releases=[unknown, stolen, _release(mine)], **pair)
    assert list(reply.released) == [mine.lease_id]
    assert _held(server, theirs, client="c2") and (server.data_root / theirs.path).is_file()


def test_carried_releases_are_checked_before_anything_changes(server: Any) -> None:
    held = _lease(server, "checked", 10)
    for releases, words in (
        ([_release(held)] * 17, "the number of releases 17"),
        ([_release(held, client="c2")], "releases[0] is of another client_id"),
        (
            [pb.ReleaseLeaseRequest(lease_id=held.lease_id, client_id="c1", waited_s=-1.0)],
            "waited_s -1.0 is outside the allowed range",
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            _lease(server, "checked", 12, releases=releases)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (err.value.details() or "")
        assert _held(server, held)


def test_a_carried_release_holds_when_the_lease_call_fails(server: Any) -> None:
    pair = {"world_size": 2}
    held = _lease(server, "refused", 0, **pair)
    consumed = server.split_stats("refused")["consumed_files"]
    with pytest.raises(grpc.RpcError) as err:  # seq 1 is not rank 0's of 2
        _lease(server, "refused", 1, releases=[_release(held)], **pair)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not _held(server, held)
    assert server.split_stats("refused")["consumed_files"] == consumed + 1
    # The client, not knowing, releases it on its own: done, and counted once.
    server.stub.ReleaseLease(_release(held), timeout=10)
    assert server.split_stats("refused")["consumed_files"] == consumed + 1


class _Calls:
    """The client's RPCs by method, counted where the client makes them (Rpc.call). With
    `old_wire`, AcquireLease goes out and comes back as a server without carried releases
    would have it: the field dropped from the request, the reply saying nothing of them."""

    def __init__(self, client: QueueClient, *, old_wire: bool = False) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._call = client._rpc.call
        self._old_wire = old_wire
        client._rpc.call = self  # type: ignore[method-assign]

    def __call__(self, method: str, request: Any, **kw: Any) -> Any:
        with self._lock:
            self.counts[method] += 1
        try:
            return self._send(method, request, **kw)
        except Exception:
            with self._lock:  # a lease call that failed (no file in time on a busy machine)
                self.counts[f"{method} failed"] += 1
            raise

    def _send(self, method: str, request: Any, **kw: Any) -> Any:
        if not (self._old_wire and method == "AcquireLease"):
            return self._call(method, request, **kw)
        stripped = pb.AcquireLeaseRequest()
        stripped.CopyFrom(request)
        stripped.ClearField("releases")
        reply = pb.Lease()
        reply.CopyFrom(self._call(method, stripped, **kw))
        reply.ClearField("released")
        reply.carries_releases = False
        return reply


def _read_files(client: QueueClient, files: int) -> None:
    for _ in range(files * BATCHES_PER_FILE):
        client.get_batch("train")


def test_a_stream_makes_one_rpc_per_file(server: Any) -> None:
    files = 8
    with QueueClient(server.address, "stream") as client:
        calls = _Calls(client)
        _read_files(client, files)
        # The 8th file is read but not yet released: it goes at the next switch or close.
        wait_until(
            lambda: server.split_stats("stream")["consumed_files"] == files - 1,
            what="the finished files released",
        )
        assert client.carries_releases
        # A lease call that failed (its file not made within a wait slice) leaves the one
        # release it carried to a ReleaseLease of its own.
        failed = calls.counts["AcquireLease failed"]
        assert calls.counts["ReleaseLease"] <= failed, calls.counts
        assert files <= calls.counts["AcquireLease"] - failed <= files + 4, calls.counts
    assert server.split_stats("stream")["consumed_files"] == files


def test_without_carried_releases_each_finished_file_is_released_on_its_own(server: Any) -> None:
    files = 8
    with QueueClient(server.address, "oldwire") as client:
        calls = _Calls(client, old_wire=True)
        _read_files(client, files)
        wait_until(
            lambda: server.split_stats("oldwire")["consumed_files"] == files - 1,
            what="the finished files released",
        )
        assert not client.carries_releases
        assert calls.counts["ReleaseLease"] == files - 1, calls.counts
    assert server.split_stats("oldwire")["consumed_files"] == files


def test_a_fetch_given_up_before_it_starts_still_releases_what_it_carries(server: Any) -> None:
    with QueueClient(server.address, "cancel", prefetch_files=1) as client:
        client.get_batch("train")
        stream = client._streams["train"]
        finished = stream._fetch(None, 0, False, time.monotonic(), [])
        consumed = server.split_stats("cancel")["consumed_files"]
        job: Future[Any] = Future()
        job.cancel()  # as _give_back_pending does to a fetch no thread has started
        stream._fetch_into(job, None, 0, False, time.monotonic(), 0, [finished])
        assert finished.lease.released
        assert server.split_stats("cancel")["consumed_files"] == consumed + 1
