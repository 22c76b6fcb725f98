"""Batch files over the network: FetchFile, the client's "grpc" transport, "auto", and TLS.

One module server serves identical char datasets under several names (a file is a pure
function of config, seed, split and seq, so they hold the same batches), one per test that
consumes: `chars` gives the reference batches through files, the others are read through
gRPC and compared with it. TLS and the restart tests start their own servers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from auditor import audit
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerFactory, ServerProcess, subprocess_env, tiny_corpus, wait_until
from queue_client import QueueClient, errors
from queue_client.format.batchfile import load_batch_file, scan_queue
from queue_client.format.layout import root_id_file
from queue_client.streaming.fetch import FileFetcher
from queue_client.streaming.stream import LeaseRef
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc
from queue_client.wire.rpc import Rpc
from queue_server.app import ensure_root_id
from queue_server.config.server import parse_config

CHUNK = 64 << 10  # the smallest chunk a client may ask for: several per file
NB = 5  # batches per file
STEPS = 30  # batches the trainers read: six files
TOKEN = "transport-test-token"
SERVING = health_pb2.HealthCheckResponse.SERVING


def char_table(name: str, corpus: Path, batch_size: int = 4, block_size: int = 16, nb: int = NB):
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "char_lm"
        batch_size = {batch_size}
        batches_per_file = {nb}
        [datasets.{name}.args]
        input = "{corpus.as_posix()}"
        block_size = {block_size}
        """
    )


@dataclass
class Module:
    server: ServerProcess
    tmp: Path
    reference: list[tuple[torch.Tensor, torch.Tensor]]  # the first STEPS train batches


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Module]:
    tmp = tmp_path_factory.mktemp("transport")
    corpus = tiny_corpus(tmp / "corpus.txt")
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        char_table(name, corpus) for name in ("chars", "twin", "ghost", "victim", "lossy", "gpu")
    )
    # Files of several 64 KiB chunks each.
    config += char_table("big", corpus, batch_size=64, block_size=256, nb=10)
    factory = ServerFactory(tmp)
    server = factory(config)
    with QueueClient(server.address, "chars", transport="file", timeout_s=60) as client:
        assert client.transport == "file"
        reference = []
        for _ in range(STEPS):
            x, y = client.get_batch("train")
            reference.append((x.clone(), y.clone()))
    yield Module(server, tmp, reference)
    factory.close()


def empty_dir(tmp_path: Path, name: str = "elsewhere") -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def batch_hash(x: torch.Tensor, y: torch.Tensor) -> str:
    return hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


# ---- the RPC --------------------------------------------------------------------------------


def test_fetch_file_streams_the_leased_file_in_chunks(module: Module) -> None:
    """FetchFile sends the leased file in order, in chunks of at most the size asked for (64 KiB
    here), the first with the lease's size and crc32; joined, they are the bytes on the
    server's disk. FileFetcher assembles and verifies the same bytes from several chunks, and
    refuses a file over its max_bytes; a chunk size out of range is INVALID_ARGUMENT."""
    stub = module.server.stub
    lease = stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset="big", split="train", client_id="me", seq=0, wait_ms=30000),
        timeout=60,
    )
    try:
        on_disk = (module.server.data_root / lease.path).read_bytes()
        chunks = list(
            stub.FetchFile(
                pb.FetchFileRequest(lease_id=lease.lease_id, client_id="me", max_chunk_bytes=CHUNK),
                timeout=30,
            )
        )
        assert len(chunks) == -(-len(on_disk) // CHUNK) >= 2
        assert all(0 < len(c.data) <= CHUNK for c in chunks)
        assert [c.offset_bytes for c in chunks] == [
            sum(len(c.data) for c in chunks[:i]) for i in range(len(chunks))
        ]
        assert (chunks[0].size_bytes, chunks[0].crc32) == (lease.size_bytes, lease.crc32)
        assert all(c.size_bytes == 0 for c in chunks[1:])
        assert b"".join(c.data for c in chunks) == on_disk
        assert zlib.crc32(on_disk) == lease.crc32

        rpc = Rpc(module.server.address)
        try:
            fetcher = FileFetcher(
                rpc, "me", max_bytes=len(on_disk), timeout_s=30, chunk_bytes=CHUNK
            )
            assert fetcher.fetch(lease.lease_id, lease.size_bytes, lease.crc32, "big/0") == on_disk
            small = FileFetcher(rpc, "me", max_bytes=len(on_disk) - 1, timeout_s=30)
            with pytest.raises(errors.InvalidRequest, match="max_fetch_bytes"):
                small.fetch(lease.lease_id, lease.size_bytes, lease.crc32, "big/0")
        finally:
            rpc.close()
        for bad in (1, (16 << 20) + 1, -1):
            request = pb.FetchFileRequest(
                lease_id=lease.lease_id, client_id="me", max_chunk_bytes=bad
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stub.FetchFile(request, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_chunk_bytes" in err.value.details()
    finally:
        stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="me", outcome=pb.RETURNED),
            timeout=30,
        )
    audit(module.server, "big")


def test_fetching_a_lease_you_do_not_hold_is_refused(module: Module) -> None:
    """Another client's lease is FAILED_PRECONDITION, an unknown or released one NOT_FOUND;
    the client maps them to LeaseConflict and UnknownLease."""
    stub = module.server.stub
    lease = stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset="big", split="val", client_id="holder", wait_ms=30000),
        timeout=60,
    )

    def fetch(lease_id: str, client_id: str) -> None:
        request = pb.FetchFileRequest(lease_id=lease_id, client_id=client_id)
        list(stub.FetchFile(request, timeout=30))

    with pytest.raises(grpc.RpcError) as err:
        fetch(lease.lease_id, "intruder")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another client" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        fetch("0" * 32, "holder")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    rpc = Rpc(module.server.address)
    try:
        intruder = FileFetcher(rpc, "intruder", max_bytes=1 << 30, timeout_s=30)
        with pytest.raises(errors.LeaseConflict):
            intruder.fetch(lease.lease_id, lease.size_bytes, lease.crc32, "big/val")
    finally:
        rpc.close()
    stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="holder", outcome=pb.RETURNED),
        timeout=30,
    )
    with pytest.raises(grpc.RpcError) as err:
        fetch(lease.lease_id, "holder")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    audit(module.server, "big")


# ---- the client's transports ----------------------------------------------------------------


def test_grpc_transport_reads_exactly_the_batches_files_give(module: Module, tmp_path) -> None:
    """transport="grpc" with a data_root that holds nothing: every batch equals the one the
    file transport read, in the same order, and the books balance."""
    with QueueClient(
        module.server.address, "twin", transport="grpc", data_root=empty_dir(tmp_path)
    ) as client:
        assert client.transport == "grpc"
        for step, (x_ref, y_ref) in enumerate(module.reference):
            x, y = client.get_batch("train")
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref), f"batch {step}"
    consumed = {"train": [(s, o) for s in range(STEPS // NB) for o in range(NB)]}
    audit(module.server, "twin", consumed_batches=consumed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_grpc_transport_on_cuda_gives_the_same_batches(module: Module, tmp_path) -> None:
    """Streamed files go through the same pinned staging to the GPU as mapped ones."""
    with QueueClient(
        module.server.address,
        "gpu",
        device="cuda",
        transport="grpc",
        data_root=empty_dir(tmp_path),
    ) as client:
        got = [client.get_batch("train") for _ in range(2 * NB)]
        torch.cuda.synchronize()
    for (ex, ey), (gx, gy) in zip(module.reference, got, strict=False):
        assert gx.is_cuda and gy.is_cuda
        assert torch.equal(gx.cpu(), ex) and torch.equal(gy.cpu(), ey)


def test_auto_streams_unless_the_data_root_is_the_servers_own(module: Module, tmp_path) -> None:
    """ "auto" reads files where the server's root id is found under data_root, and streams
    everywhere else: an empty directory, or a copy of the root with another id. The same copy
    holding the server's id counts as the root itself: the id decides, not the path."""
    server = module.server
    root_id = root_id_file(server.data_root).read_text().strip()
    meta = server.stub.GetMeta(pb.GetMetaRequest(dataset="chars"), timeout=30)
    assert meta.data_root_id == root_id and len(root_id) == 32

    copy = tmp_path / "copy"
    (copy / "chars").mkdir(parents=True)
    shutil.copy(server.data_root / "chars" / "meta.pkl", copy / "chars" / "meta.pkl")
    root_id_file(copy).write_text("f" * 32 + "\n")
    cases = [(None, "file"), (empty_dir(tmp_path), "grpc"), (copy, "grpc")]
    for data_root, expected in cases:
        with QueueClient(server.address, "chars", data_root=data_root) as client:
            assert client.transport == expected, data_root
    root_id_file(copy).write_text(root_id + "\n")
    with QueueClient(server.address, "chars", data_root=copy) as client:
        assert client.transport == "file"

    with QueueClient(
        server.address, "chars", transport="file", data_root=empty_dir(tmp_path, "nothing")
    ) as client:
        with pytest.raises(errors.InvalidRequest, match='transport="grpc"'):
            client.get_batch("train")
    with pytest.raises(errors.InvalidRequest, match="transport 'nfs'"):
        QueueClient(server.address, "chars", transport="nfs")


def test_the_root_id_is_made_once_per_data_root(tmp_path: Path) -> None:
    """The same root keeps its id (a restarted server publishes the same one); another root
    gets another; a damaged id file is replaced."""
    (tmp_path / "a").mkdir()
    first = ensure_root_id(tmp_path / "a")
    assert ensure_root_id(tmp_path / "a") == first
    assert root_id_file(tmp_path / "a").read_text() == first + "\n"
    (tmp_path / "b").mkdir()
    assert ensure_root_id(tmp_path / "b") != first
    root_id_file(tmp_path / "b").write_text("not an id")
    assert len(ensure_root_id(tmp_path / "b")) == 32


TRAINER = """
import hashlib, json, os, sys
import torch
from queue_client import QueueClient

address, steps = sys.argv[1], int(sys.argv[2])
with QueueClient(address, "ghost", timeout_s=60) as client:  # transport "auto"
    seen = sorted(os.listdir(client.data_root))
    vocab = int(client.meta["vocab_size"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    losses, hashes = [], []
    for _ in range(steps):
        x, y = client.get_batch("train")
        hashes.append(hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(json.dumps({"transport": client.transport, "root": str(client.data_root),
                      "seen": seen, "losses": losses, "hashes": hashes}))
"""


def hidden_root_command(root: Path, *argv: str) -> list[str]:
    """argv run in a mount namespace where `root` is an empty tmpfs (private: the host's
    view of it is untouched)."""
    script = 'mount -t tmpfs tmpfs "$1" && shift && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(root), *argv]


def test_a_trainer_that_cannot_see_the_data_root_trains_through_grpc(module: Module) -> None:
    """A trainer process whose view of the data root is an empty tmpfs (its own mount
    namespace) picks "grpc" by itself, trains (the loss falls), and reads exactly the
    batches the file transport read."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to hide the data root from a process")
    root = module.server.data_root
    probe = subprocess.run(
        hidden_root_command(root, "true"), capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {probe.stderr.strip()}")
    proc = subprocess.run(
        hidden_root_command(root, sys.executable, "-c", TRAINER, module.server.address, str(STEPS)),
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["root"] == str(root) and out["seen"] == []  # the server's root, hidden
    assert out["transport"] == "grpc"
    assert out["hashes"] == [batch_hash(x, y) for x, y in module.reference]
    losses = out["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert root_id_file(root).exists()  # the host still sees the root
    consumed = {"train": [(s, o) for s in range(STEPS // NB) for o in range(NB)]}
    audit(module.server, "ghost", consumed_batches=consumed)


def test_a_file_failing_its_checksum_is_fetched_again_once_then_made_again(
    module: Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A published file damaged on the server's disk (same size, one byte flipped): the
    server streams it as it is, the client finds the crc32 wrong, fetches it once more, then
    reports it CORRUPT. The server quarantines it and makes the seq again, and the stream
    loses nothing: the batches are those of the undamaged file."""
    server = module.server
    qdir = server.data_root / "victim" / "queue" / "train"
    name = wait_until(
        lambda: next((n for n in scan_queue(qdir) if n.seq == 0), None), 120, "victim seq 0"
    )
    victim = qdir / str(name)
    expected = load_batch_file(victim).tensors["x"].clone()
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.WARNING, logger="queue_client")
    with QueueClient(
        server.address, "victim", transport="grpc", data_root=empty_dir(tmp_path)
    ) as client:
        for offset in range(NB):
            x, _ = client.get_batch("train")
            assert torch.equal(x, expected[offset]), offset
    again = [r for r in caplog.records if "fetching it again" in r.getMessage()]
    assert len(again) == 1 and "crc32" in again[0].getMessage(), caplog.text
    stats = audit(server, "victim", consumed_batches={"train": [(0, o) for o in range(NB)]})
    assert stats["train"]["quarantined_files"] == 1 and stats["train"]["reproduced_files"] >= 1
    reason = (
        server.data_root / "victim" / "quarantine" / "train" / f"{name}.reason.txt"
    ).read_text()
    assert "crc32" in reason and "fetched 2 times" in reason


class LosesItsFirstLease(QueueClient):
    """Gives its first lease back behind its own back just before fetching the file, as a
    server restart between AcquireLease and FetchFile would lose it."""

    lost = 0

    def fetch_file(self, ref: LeaseRef, lease: pb.Lease) -> bytes:
        if not self.lost:
            self.lost += 1
            request = pb.ReleaseLeaseRequest(
                lease_id=ref.lease_id, client_id=self.client_id, outcome=pb.RETURNED
            )
            self._rpc.call("ReleaseLease", request)
        return super().fetch_file(ref, lease)


def test_a_lease_lost_before_its_file_arrived_is_taken_again(module: Module, tmp_path) -> None:
    """FetchFile answers NOT_FOUND for a lease the server no longer holds: the client leases
    the same file again and reads on, with nothing skipped and nothing quarantined."""
    with LosesItsFirstLease(
        module.server.address, "lossy", transport="grpc", data_root=empty_dir(tmp_path)
    ) as client:
        for step, (x_ref, y_ref) in enumerate(module.reference[: 2 * NB]):
            x, y = client.get_batch("train")
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref), f"batch {step}"
        assert client.lost == 1
    stats = audit(
        module.server,
        "lossy",
        consumed_batches={"train": [(s, o) for s in (0, 1) for o in range(NB)]},
    )
    assert stats["train"]["quarantined_files"] == 0


READER = """
import json, sys
from queue_client import QueueClient

address, root, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
with QueueClient(address, "d", transport="grpc", data_root=root, reconnect_timeout_s=90,
                 timeout_s=120) as client:
    for _ in range(total):
        pos = client.state_dict()["splits"].get("train", {"seq": 0, "offset": 0})
        client.get_batch("train")
        print(json.dumps([pos["seq"], pos["offset"] // client.file_batch_size]), flush=True)
"""


def test_a_streaming_client_survives_a_server_restart(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """The server SIGKILLed and restarted while a streaming client reads (its leases, and
    maybe a FetchFile in flight, are lost): the client carries on and reads every batch
    exactly once, in order."""
    sock, root = tmp_path / "bq.sock", tmp_path / "root"
    config = "[server]\nlease_ttl_s = 30\n" + char_table("d", corpus)
    server = start_server(config, data_root=root, listen=f"unix:{sock}")
    files = 12
    with open(tmp_path / "reader.err", "w") as err_file:
        reader = subprocess.Popen(
            [
                sys.executable,
                "-c",
                READER,
                server.address,
                str(empty_dir(tmp_path)),
                str(files * NB),
            ],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            env=subprocess_env(),
        )
    try:
        read = [tuple(json.loads(reader.stdout.readline())) for _ in range(2 * NB + 2)]
        server.kill(signal.SIGKILL)
        server = start_server(config, data_root=root, listen=f"unix:{sock}")
        read += [tuple(json.loads(line)) for line in reader.stdout]  # until the reader exits
        reader.wait(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)
        reader.stdout.close()
    assert reader.returncode == 0, (tmp_path / "reader.err").read_text()
    assert read == [(s, o) for s in range(files) for o in range(NB)]
    audit(server, "d")


# ---- TLS -------------------------------------------------------------------------------------


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, made now, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl(1) here to make a test certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_with_a_certificate_made_on_the_fly(start_server, corpus: Path, tmp_path) -> None:
    """A server with tls_cert_file/tls_key_file and a token: a client that trusts the
    certificate and sends the token reads batches through files and through gRPC. Plaintext
    fails, naming tls_ca_file; so does a client that trusts another certificate; without the
    token it is PermissionDenied, FetchFile included."""
    cert, key = self_signed(tmp_path, "server")
    other, _ = self_signed(tmp_path, "other")
    config = textwrap.dedent(
        f"""
        [server]
        auth_token = "{TOKEN}"
        tls_cert_file = "{cert.as_posix()}"
        tls_key_file = "{key.as_posix()}"
        """
    ) + char_table("d", corpus)
    server = start_server(config, wait_serving=False)
    channel = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(cert.read_bytes()))
    try:
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(
            lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == SERVING,
            120,
            "SERVING over TLS",
        )
        for transport, data_root in (("file", None), ("grpc", empty_dir(tmp_path))):
            with QueueClient(
                server.address,
                "d",
                tls_ca_file=cert,
                auth_token=TOKEN,
                transport=transport,
                data_root=data_root,
            ) as client:
                assert client.transport == transport
                for _ in range(2 * NB):
                    x, y = client.get_batch("train")
                    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one character
        with pytest.raises(errors.ServerUnavailable, match="tls_ca_file"):
            QueueClient(server.address, "d", auth_token=TOKEN, reconnect_timeout_s=1)
        with pytest.raises(errors.ServerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            QueueClient(server.address, "d", tls_ca_file=other, auth_token=TOKEN)
        with pytest.raises(errors.PermissionDenied, match="token"):
            QueueClient(server.address, "d", tls_ca_file=cert, auth_token="wrong")
        fetch = pb.FetchFileRequest(lease_id="0" * 32, client_id="intruder")
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.BatchQueueStub(channel).FetchFile(fetch, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


def test_tls_config_is_checked(tmp_path: Path) -> None:
    """Paths are relative to the config file; cert and key go together; a unix socket takes
    no TLS; a certificate that cannot be read stops the server before it touches its data
    root, naming the key and the path."""
    parsed = parse_config(
        {"server": {"tls_cert_file": "c.pem", "tls_key_file": "k.pem"}}, config_dir=tmp_path
    )
    assert (parsed.tls_cert_file, parsed.tls_key_file) == (
        str(tmp_path / "c.pem"),
        str(tmp_path / "k.pem"),
    )
    with pytest.raises(errors.ConfigError, match="tls_key_file is not"):
        parse_config({"server": {"tls_cert_file": "c.pem"}}, config_dir=tmp_path)
    with pytest.raises(errors.ConfigError, match="unix socket"):
        parse_config(
            {
                "server": {
                    "listen": "unix:/tmp/x.sock",
                    "tls_cert_file": "c.pem",
                    "tls_key_file": "k.pem",
                }
            },
            config_dir=tmp_path,
        )
    config = tmp_path / "config.toml"
    config.write_text('[server]\ntls_cert_file = "missing.pem"\ntls_key_file = "missing.pem"\n')
    root = tmp_path / "root"
    argv = [sys.executable, "-m", "queue_server", "--config", str(config)]
    argv += ["--listen", "127.0.0.1:0", "--metrics-listen", "", "--data-root", str(root)]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert f"server.tls_cert_file = '{tmp_path / 'missing.pem'}' cannot be read" in proc.stderr
    assert not root.exists()
