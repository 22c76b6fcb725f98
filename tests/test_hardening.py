"""Inputs that used to stall, crash or trespass: bombed meta.pkl files, a deleted root lock,
someone else's unix socket, absurd numbers in the config, an address where nothing listens."""

from __future__ import annotations

import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from conftest import ServerFactory, subprocess_env, wait_until
from queue_client import QueueClient, errors
from queue_client.errors import ConfigError, MetaError
from queue_client.format.layout import root_lock_file
from queue_client.format.meta import (
    MAX_META_FILE_BYTES,
    dump_meta,
    load_meta,
    loads_plain,
    meta_from_json,
    meta_to_json,
)
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.config.server import load_config

SERVING = health_pb2.HealthCheckResponse.SERVING


def tiny(name: str = "d", server: str = "") -> str:
    return textwrap.dedent(
        f"""
        [server]
        {server}
        [datasets.{name}]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 3
        """
    )


def run_server(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """queue-server in the foreground, expected to exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "queue_server", "--metrics-listen", "", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=subprocess_env(),
    )


# ---- a) meta.pkl bombs --------------------------------------------------------------------


def shared_bomb(levels: int, leaf_bytes: int = 100) -> list[Any]:
    """A list that holds one list twice, `levels` deep: pickled, each level costs a few
    bytes; written out, 2**levels copies of the leaf."""
    node: list[Any] = ["x" * leaf_bytes]
    for _ in range(levels):
        node = [node, node]
    return node


def test_a_tiny_meta_pkl_that_expands_to_gigabytes_is_refused_at_once(tmp_path: Path) -> None:
    """25 levels of shared references: a few hundred bytes on disk, 3.3 GB written out."""
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"dataset_name": "d", "vocab": shared_bomb(25)}, protocol=4))
    assert path.stat().st_size < 1024
    began = time.monotonic()
    with pytest.raises(MetaError) as info:
        load_meta(path)
    assert time.monotonic() - began < 2.0
    message = str(info.value)
    assert str(path) in message and "MAX_META_JSON_BYTES" in message and "stopped at" in message


def test_meta_to_json_refuses_an_expanding_meta_before_writing_it() -> None:
    """A meta that reached meta_to_json without load_meta (a provider's build_meta) is
    measured there too, naming where it came from."""
    meta = {"dataset_name": "d", "vocab": shared_bomb(19, leaf_bytes=200)}  # ~105 MB of JSON
    with pytest.raises(MetaError, match=r"provider d expands past MAX_META_JSON_BYTES"):
        meta_to_json(meta, where="provider d")


def test_a_meta_pkl_with_a_reference_cycle_is_refused(tmp_path: Path) -> None:
    loop: list[Any] = []
    loop.append(loop)
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"dataset_name": "d", "loop": loop}, protocol=4))
    with pytest.raises(MetaError, match="reference cycle") as info:
        load_meta(path)
    assert str(path) in str(info.value)
    with pytest.raises(MetaError, match="reference cycle"):
        meta_to_json(loads_plain(path.read_bytes()))


def test_an_oversized_meta_pkl_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "meta.pkl"
    with open(path, "wb") as f:
        f.truncate(MAX_META_FILE_BYTES + 1)  # sparse: no need to write 32 MiB
    with pytest.raises(MetaError, match="MAX_META_FILE_BYTES") as info:
        load_meta(path)
    assert str(path) in str(info.value)


def test_a_real_sized_vocabulary_passes_the_limits(tmp_path: Path) -> None:
    """The limits leave room for a 100k-token vocabulary, both ways (itos and stoi)."""
    itos = {i: f"token-{i}" for i in range(100_000)}
    meta = {"itos": itos, "stoi": {v: k for k, v in itos.items()}, "shared": [itos] * 2}
    path = tmp_path / "meta.pkl"
    dump_meta(path, meta)
    assert meta_from_json(meta_to_json(load_meta(path))) == meta


def test_a_server_with_a_bombed_meta_pkl_fails_the_dataset_and_keeps_answering(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """A valid meta.pkl with a bomb added: the dataset fails naming the file and the limit;
    the server answers every RPC meanwhile."""
    root = tmp_path / "data"
    first = start_server(tiny(), data_root=root)
    first.stop()
    meta_path = root / "d" / "meta.pkl"
    meta = loads_plain(meta_path.read_bytes())
    meta["bomb"] = shared_bomb(19, leaf_bytes=200)
    dump_meta(meta_path, meta)
    server = start_server(tiny(), data_root=root, wait_serving=False, args=("--keep-serving",))
    assert server.stub.Ping(pb.PingRequest(), timeout=5) is not None
    wait_until(lambda: server.stats("d")["state"] == "failed", 60, "the dataset to fail")
    error = server.stats("d")["last_error"]
    assert str(meta_path) in error and "MAX_META_JSON_BYTES" in error, error


# ---- b) the data root lock ----------------------------------------------------------------


def test_deleting_the_lock_file_does_not_let_a_second_server_in(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """The lock is on the data root directory itself; the file only names the holder."""
    root = tmp_path / "data"
    first = start_server(tiny(), data_root=root)
    lock_file = root_lock_file(root)
    assert lock_file.read_text().strip() == str(first.proc.pid)
    lock_file.unlink()
    second = run_server(
        "--listen", "127.0.0.1:0", "--data-root", str(root), "--config", "/dev/null"
    )
    assert second.returncode == 2, second.stderr
    assert (
        f"data root {root} is in use by another queue-server (pid {first.proc.pid})"
        in second.stderr
    ), second.stderr
    assert first.health() == SERVING
    first.kill(signal.SIGKILL)
    start_server(tiny(), data_root=root)  # the lock died with its holder


# ---- c) unix socket paths -----------------------------------------------------------------


def test_a_regular_file_at_the_socket_path_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "bq.sock"
    path.write_text("not a socket\n")
    proc = run_server("--listen", f"unix:{path}", "--data-root", str(tmp_path / "data"))
    assert proc.returncode != 0
    assert f"cannot listen on unix:{path}: {path} exists and is not a socket" in proc.stderr, (
        proc.stderr
    )
    assert path.read_text() == "not a socket\n"


def test_a_live_servers_socket_is_not_taken_over(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    sock = tmp_path / "bq.sock"
    first = start_server(tiny(), data_root=tmp_path / "a", listen=f"unix:{sock}")
    inode = sock.stat().st_ino
    proc = run_server("--listen", f"unix:{sock}", "--data-root", str(tmp_path / "b"))
    assert proc.returncode != 0
    assert f"cannot listen on unix:{sock}: another server is listening" in proc.stderr, proc.stderr
    assert sock.stat().st_ino == inode
    assert first.health() == SERVING
    with QueueClient(first.address, "d") as client:
        assert client.get_batch("train")[0].shape == (2, 4)


def test_a_stale_socket_of_a_killed_server_is_replaced(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    sock = tmp_path / "bq.sock"
    first = start_server(tiny(), data_root=tmp_path / "data", listen=f"unix:{sock}")
    first.kill(signal.SIGKILL)
    assert sock.exists()  # SIGKILL leaves the socket file behind
    second = start_server(tiny(), data_root=tmp_path / "data", listen=f"unix:{sock}")
    with QueueClient(second.address, "d") as client:
        assert client.get_batch("train")[0].shape == (2, 4)


# ---- d) numbers in the config -------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ("lease_ttl_s = inf", "server.lease_ttl_s", "inf"),
        ("lease_ttl_s = nan", "server.lease_ttl_s", "nan"),
        ("lease_ttl_s = -1", "server.lease_ttl_s", "-1"),
        ("lease_ttl_s = 1e300", "server.lease_ttl_s", "1e+300"),
        ("lease_ttl_s = 1e-9", "server.lease_ttl_s", "1e-09"),
        ("acquire_wait_s = inf", "server.acquire_wait_s", "inf"),
        ("acquire_wait_s = -inf", "server.acquire_wait_s", "-inf"),
        ("acquire_wait_s = 1e9", "server.acquire_wait_s", "1000000000.0"),
    ],
)
def test_non_finite_and_absurd_durations_are_refused_naming_the_range(
    tmp_path: Path, line: str, key: str, value: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(tiny(server=line))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{key} = {value} is invalid: expected a number of seconds in [" in str(info.value)


def test_candidate_oversample_inf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(tiny() + 'selection = "curriculum"\ncandidate_oversample = inf\n')
    with pytest.raises(ConfigError, match=r"datasets\.d\.candidate_oversample = inf .*\[1, 1000\]"):
        load_config(path)


def test_the_cli_exits_2_on_an_infinite_lease_ttl(tmp_path: Path) -> None:
    """lease_ttl_s = inf used to pass and then raise OverflowError deep in the server."""
    path = tmp_path / "c.toml"
    path.write_text(tiny(server="lease_ttl_s = inf"))
    proc = run_server("--config", str(path), "--listen", "127.0.0.1:0")
    assert proc.returncode == 2, proc.stderr
    assert "server.lease_ttl_s = inf is invalid: expected a number of seconds in [0.1, 86400]" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


# ---- e) an address where nothing answers --------------------------------------------------


def _fails_fast_naming(address: str) -> None:
    began = time.monotonic()
    with pytest.raises(errors.ServerUnavailable) as info:
        QueueClient(address, "d")
    elapsed = time.monotonic() - began
    assert elapsed < 5.0, f"took {elapsed:.1f}s"
    assert address in str(info.value)


def test_a_free_port_fails_within_5s_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails_fast_naming(f"127.0.0.1:{port}")


def test_a_missing_unix_socket_fails_within_5s_naming_the_address(tmp_path: Path) -> None:
    _fails_fast_naming(f"unix:{tmp_path / 'nobody.sock'}")


def test_a_listener_that_never_speaks_fails_within_5s() -> None:
    """The TCP handshake completes (the kernel accepts into the backlog) but no HTTP/2 ever
    comes back: the connection never becomes ready, as with a host that drops packets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        _fails_fast_naming(f"127.0.0.1:{s.getsockname()[1]}")
