"""Security defaults against real server processes: where the server listens, the shared token,
and nothing read from disk can run code or reach outside the data root.

Two module servers: `open_server` listens on 0.0.0.0 without a token (and serves datasets
whose files the tests tamper with); `locked_server` listens on a unix socket with a group
mode and requires a token.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
import shutil
import stat
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from auditor import audit, split_ints
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2

from conftest import ServerFactory, ServerProcess, char_config, run_client_script, wait_until
from queue_client import QueueClient, errors
from queue_client.format.batchfile import load_batch_file, scan_queue
from queue_client.wire import batchqueue_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN = "s3cret-token-for-tests"


class TouchOnUnpickle:
    """Unpickling this runs Path.touch(marker): a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def tiny(name: str) -> str:
    return textwrap.dedent(
        f"""
        [datasets.{name}]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 3
        """
    )


@dataclass
class OpenServer:
    server: ServerProcess
    tmp: Path  # holds data/ (the data root), outside/ and the markers


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenServer]:
    """0.0.0.0, no token; dataset `poisoned` has a meta.pkl that would run code if unpickled."""
    tmp = tmp_path_factory.mktemp("open")
    (tmp / "outside").mkdir()
    poisoned = tmp / "data" / "poisoned"
    poisoned.mkdir(parents=True)
    (poisoned / "meta.pkl").write_bytes(
        pickle.dumps({"dataset_name": "poisoned", "x": TouchOnUnpickle(tmp / "meta-marker")})
    )
    factory = ServerFactory(tmp)
    config = "[server]\nlease_ttl_s = 30\n" + "".join(
        tiny(n) for n in ("sym", "evil", "elsewhere", "poisoned")
    )
    server = factory(config, listen="0.0.0.0:0", wait_serving=False, args=("--keep-serving",))
    for name in ("sym", "evil", "elsewhere"):
        wait_until(
            lambda name=name: server.health(f"batchqueue.v1.BatchQueue/{name}") == SERVING,
            60,
            f"{name} SERVING",
        )
    yield OpenServer(server, tmp)
    factory.close()


@dataclass
class TokenView:
    """What the auditor needs from a server that wants a token."""

    stub: Any
    data_root: Path

    def stats(self, dataset: str) -> dict[str, Any]:
        reply = self.stub.GetStats(
            pb.GetStatsRequest(dataset=dataset), timeout=30, metadata=bearer(TOKEN)
        )
        return MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A unix socket with mode 0660 from config, and a token; returns the server and socket."""
    tmp = tmp_path_factory.mktemp("locked")
    sock = tmp / "bq.sock"
    factory = ServerFactory(tmp)
    config = f'[server]\nunix_socket_mode = 0o660\nauth_token = "{TOKEN}"\n' + tiny("d")
    yield factory(config, listen=f"unix:{sock}"), sock
    factory.close()


def first_file(server: ServerProcess, dataset: str) -> Path:
    """The published file of seq 0 of dataset/train, once it exists."""
    qdir = server.data_root / dataset / "queue" / "train"
    name = wait_until(
        lambda: next((n for n in scan_queue(qdir) if n.seq == 0), None), 30, f"{dataset} seq 0"
    )
    return qdir / str(name)


# ---- where the server listens ----------------------------------------------------------------


def test_warns_when_listening_beyond_loopback_without_a_token(open_server: OpenServer) -> None:
    """Bound to 0.0.0.0 without server.auth_token: the log warns and says what to set."""
    log = open_server.server.log()
    assert re.search(
        r"WARNING .*0\.0\.0\.0.*reachable from other hosts.*server\.auth_token", log
    ), log


def test_unix_socket_takes_its_mode_from_config_and_is_not_warned_about(locked_server) -> None:
    """server.unix_socket_mode = 0o660 gives the socket that mode; a socket is host-local."""
    server, sock = locked_server
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o660
    assert "reachable from other hosts" not in server.log()


# ---- the token ----------------------------------------------------------------------------

CALLS = [
    ("ListDatasets", pb.ListDatasetsRequest()),
    ("GetMeta", pb.GetMetaRequest(dataset="d")),
    ("GetSchema", pb.GetSchemaRequest(dataset="d", split="train")),
    ("GetStats", pb.GetStatsRequest(dataset="d")),
    (
        "AcquireLease",
        pb.AcquireLeaseRequest(dataset="d", split="train", client_id="intruder", wait_ms=100),
    ),
    (
        "ReleaseLease",
        pb.ReleaseLeaseRequest(lease_id="x", client_id="intruder", outcome=pb.CONSUMED),
    ),
    ("RenewLeases", pb.RenewLeasesRequest(client_id="intruder", lease_ids=["x"])),
    ("Ping", pb.PingRequest(payload=b"hi")),
]


@pytest.mark.parametrize(
    "metadata",
    [None, bearer("wrong"), bearer(TOKEN.upper()), (("authorization", TOKEN),)],
    ids=["none", "wrong", "case", "no-bearer"],
)
def test_every_rpc_without_the_right_token_is_unauthenticated(locked_server, metadata) -> None:
    """No token, a wrong one, or a malformed header: UNAUTHENTICATED with a message saying
    what to send (never the token itself), on every RPC; nothing gets leased."""
    server, _ = locked_server
    for method, request in CALLS:
        with pytest.raises(grpc.RpcError) as err:
            getattr(server.stub, method)(request, timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert "token" in err.value.details() and TOKEN not in err.value.details()
    stats = TokenView(server.stub, server.data_root).stats("d")
    assert all(split_ints(split)["leased_files"] == 0 for split in stats["splits"])


def test_the_right_token_works_and_health_needs_none(locked_server) -> None:
    """With the token every RPC answers; the health service answers without one; QueueClient
    takes auth_token=, and without it fails with PermissionDenied naming the address."""
    server, _ = locked_server
    assert server.health() == SERVING and server.health("batchqueue.v1.BatchQueue/d") == SERVING
    assert (
        server.stub.Ping(pb.PingRequest(payload=b"hi"), timeout=10, metadata=bearer(TOKEN)).payload
        == b"hi"
    )
    assert list(
        server.stub.ListDatasets(
            pb.ListDatasetsRequest(), timeout=10, metadata=bearer(TOKEN)
        ).datasets
    ) == ["d"]
    with pytest.raises(errors.PermissionDenied, match=re.escape(server.address)):
        QueueClient(server.address, "d", reconnect_timeout_s=1)
    with QueueClient(server.address, "d", auth_token=TOKEN) as client:
        x, y = client.get_batch("train")
        assert (y == x + 1).all()
    audit(TokenView(server.stub, server.data_root), "d")


def test_a_client_process_takes_the_token_from_the_environment(locked_server) -> None:
    """$BATCHQUEUE_TOKEN is enough for a trainer process."""
    server, _ = locked_server
    script = f"""
        from queue_client import QueueClient
        with QueueClient("{server.address}", "d") as c:
            x, _ = c.get_batch("val")
            print("shape", tuple(x.shape))
    """
    out = run_client_script(script, env={"BATCHQUEUE_TOKEN": TOKEN}).stdout
    assert "shape (2, 4)" in out
    audit(TokenView(server.stub, server.data_root), "d")


# ---- nothing outside the data root, nothing that runs code ------------------------------------


def test_a_leased_path_outside_the_data_root_is_refused(open_server: OpenServer) -> None:
    """A published file replaced by a symlink to an identical file outside the data root:
    the client refuses it with PermissionDenied, and the outside file is left alone."""
    server = open_server.server
    published = first_file(server, "sym")
    outside = open_server.tmp / "outside" / "copy.pt"
    shutil.copyfile(published, outside)  # same bytes: size and crc32 match the lease
    before = outside.read_bytes()
    published.unlink()
    published.symlink_to(outside)
    with (
        QueueClient(server.address, "sym", timeout_s=30) as client,
        pytest.raises(errors.PermissionDenied, match="outside the data root"),
    ):
        client.get_batch("train")
    assert outside.read_bytes() == before
    audit(server, "sym")


def test_a_dataset_dir_linked_to_another_disk_is_read_in_place(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    """An operator may put a dataset's directory on another disk behind a symbolic link in
    the data root: the server writes through it, and a client reading files (transport
    "file", or "auto", which picks it) maps them there; a file linked out of both the root
    and that directory is still refused (the test above)."""
    data_root, disk = tmp_path / "data", tmp_path / "other-disk" / "chars"
    disk.mkdir(parents=True)
    data_root.mkdir()
    (data_root / "chars").symlink_to(disk, target_is_directory=True)
    server = start_server(char_config(corpus), data_root=data_root)
    for transport in ("file", "auto"):
        with QueueClient(server.address, "chars", timeout_s=30, transport=transport) as client:
            x, _ = client.get_batch("train")
            assert client.transport == "file" and x.shape == (4, 16)
    assert any((disk / "queue" / "train").iterdir())  # the files lie on the other disk


@pytest.mark.parametrize(
    "leased",
    ["../outside/copy.pt", "chars/queue/train/../../../../outside/copy.pt", "chars/../..", ".."],
)
def test_a_lease_naming_a_path_out_of_the_root_is_refused_before_any_read(
    tmp_path: Path, leased: str
) -> None:
    """What a rogue server could send: a lease whose path climbs out of the data root. The
    client's file map refuses it with PermissionDenied, whatever its form, before reading
    anything (a file of the lease's size lies there)."""
    from queue_client.streaming.file_map import map_leased

    root = tmp_path / "data"
    (root / "chars" / "queue" / "train").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "copy.pt").write_bytes(b"not read")
    lease = pb.Lease(path=leased, size_bytes=8, crc32=0)
    with pytest.raises(errors.PermissionDenied, match="outside the data root"):
        map_leased(root.resolve(), "chars", True, lease)


def test_a_crafted_pickle_in_the_queue_is_refused_and_quarantined(open_server: OpenServer) -> None:
    """A published file rewritten (same name, same size) as a torch zip pickle whose loading
    would create a marker file: the client (checksums off, so the loader itself is what is
    tested) refuses it, the server quarantines it with the loader's reason, the rank gets the
    real seq 0 produced again, and the marker never appears."""
    server, tmp = open_server.server, open_server.tmp
    published = first_file(server, "evil")
    original = load_batch_file(published)
    expected = original.tensors["x"].clone()
    marker = tmp / "pwned"
    published.write_bytes(crafted(marker, size=published.stat().st_size))
    control = tmp / "control.pt"
    control.write_bytes(crafted(tmp / "control-marker", size=None))
    torch.load(control, weights_only=False)  # the payload is live: plain torch.load runs it
    assert (tmp / "control-marker").exists()
    read = []
    with QueueClient(server.address, "evil", timeout_s=30, verify_checksums=False) as client:
        for offset in range(3):
            x, _ = client.get_batch("train")
            assert (x == expected[offset]).all()
            read.append((0, offset))
    assert not marker.exists()
    qdir = server.data_root / "evil" / "quarantine" / "train"
    reason = (qdir / f"{published.name}.reason.txt").read_text()
    assert "Weights only load failed" in reason or "weights_only" in reason
    stats = audit(server, "evil", consumed_batches={"train": read})["train"]
    assert stats["quarantined_files"] == 1


def crafted(marker: Path, size: int | None) -> bytes:
    """A batch file look-alike that runs Path.touch(marker) when unpickled, padded to `size`:
    a zip laid out as torch.save lays one out (archive/data.pkl, byteorder, version), stored
    uncompressed and without torch's 64-byte alignment, so that it is small enough to take
    the place of a version 3 file of any size."""
    for pad in range(4096):
        buf = io.BytesIO()
        payload = {
            "format": "batchqueue.batchfile",
            "version": 1,
            "metadata": {"seq": 0},
            "tensors": {},
            "evil": TouchOnUnpickle(marker),
            "pad": "p" * pad,
        }
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("archive/data.pkl", pickle.dumps(payload, protocol=2))
            archive.writestr("archive/byteorder", "little")
            archive.writestr("archive/version", "3\n")
        if size is None or len(buf.getvalue()) == size:
            return buf.getvalue()
    raise AssertionError(f"could not craft a {size}-byte file")


def test_a_meta_pkl_that_would_run_code_is_refused(open_server: OpenServer) -> None:
    """meta.pkl naming a callable: the dataset fails with a message naming it, the code never
    runs, and the file is left where it was."""
    server, tmp = open_server.server, open_server.tmp
    wait_until(lambda: server.stats("poisoned")["state"] == "failed", 60, "poisoned to fail")
    error = server.stats("poisoned")["last_error"]
    assert "meta.pkl" in error and "plain data" in error and "touch" in error
    assert not (tmp / "meta-marker").exists()
    assert (tmp / "data" / "poisoned" / "meta.pkl").exists()


def test_a_client_looking_in_the_wrong_data_root_is_told_so(
    open_server: OpenServer, tmp_path: Path
) -> None:
    """A client whose data_root does not hold the server's files says which root it looked in
    (with transport "file"; "auto" would stream them)."""
    empty = tmp_path / "not-the-data-root"
    empty.mkdir()
    with QueueClient(
        open_server.server.address, "elsewhere", data_root=empty, timeout_s=30, transport="file"
    ) as client:
        with pytest.raises(errors.InvalidRequest) as err:
            client.get_batch("train")
    assert str(empty) in str(err.value) and "data_root" in str(err.value)
    audit(open_server.server, "elsewhere")


def test_a_client_looking_in_the_wrong_data_root_quarantines_nothing(
    open_server: OpenServer, tmp_path: Path
) -> None:
    """The files are fine; only the client is misconfigured: nothing may be quarantined."""
    server = open_server.server
    before = server.split_stats("elsewhere")["quarantined_files"]
    empty = tmp_path / "not-the-data-root"
    empty.mkdir()
    with QueueClient(
        server.address, "elsewhere", data_root=empty, timeout_s=30, transport="file"
    ) as client:
        with pytest.raises(errors.BatchQueueError):
            client.get_batch("train")
    audit(server, "elsewhere")
    assert server.split_stats("elsewhere")["quarantined_files"] == before
