"""Row 9: batch files over the network (transport "grpc") beside the limits they live under.

9a: FetchFile of one leased file, in MB/s, beside a raw loopback TCP socket that moves the
    same bytes from a thread of this process (no framing, no checksum): the cost of gRPC
    streaming, chunking and the crc32 check. Goal: at least 0.5x the raw socket. Beside it,
    the same FetchFile read bare (chunks counted, nothing joined or checked): what gRPC's
    Python stream itself moves, the ceiling for the client's side.
9b: get_batch read through whole files (file boundaries included), with transport "grpc"
    beside transport "file" on a dataset of the same config, and beside nanoGPT's get_batch
    for the same batch shape.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid

from bench import baselines
from bench.data import Tokens
from bench.harness import Result, Settings, median
from bench.servers import Server, ServerSpec, dataset_toml

FETCH_GOAL = 0.5
SHAPE = (12, 1024)
_CHUNK = 1 << 20


def _datasets(settings: Settings, tokens: Tokens) -> tuple[str, ...]:
    nb = settings.pick(100, 4)
    b, t = SHAPE
    return tuple(
        dataset_toml(
            name,
            text=tokens.text_path,
            batch_size=b,
            block_size=t,
            batches_per_file=nb,
            backlog=2,
            workers=2,
        )
        for name in ("net_grpc", "net_file")
    )


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return [ServerSpec("transport", _datasets(settings, tokens))]


def _raw_socket_mb_s(data: bytes, repeats: int) -> float:
    """MB/s of `data` sent over loopback TCP by a thread and received into one buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(repeats):
                conn.sendall(data)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buf = bytearray(len(data))
    view = memoryview(buf)
    times = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(repeats):
            began = time.perf_counter()
            got = 0
            while got < len(data):
                n = conn.recv_into(view[got:], min(_CHUNK, len(data) - got))
                if n == 0:
                    raise ConnectionError("the raw sender closed early")
                got += n
            times.append(time.perf_counter() - began)
    sender.join(10)
    listener.close()
    return len(data) / median(times) / 1e6


def _fetch_rows(settings: Settings, server: Server) -> list[Result]:
    from queue_client.streaming.fetch import FileFetcher
    from queue_client.wire import batchqueue_pb2 as pb
    from queue_client.wire.rpc import Rpc

    rpc = Rpc(server.address)
    client_id = f"bench-fetch-{uuid.uuid4().hex[:8]}"
    lease = rpc.call(
        "AcquireLease",
        pb.AcquireLeaseRequest(
            dataset="net_grpc",
            split="train",
            rank=0,
            world_size=1,
            client_id=client_id,
            seq=0,
            wait_ms=60_000,
        ),
    )
    try:
        fetcher = FileFetcher(rpc, client_id, max_bytes=1 << 31, timeout_s=60)
        fetch_times = []
        data = b""
        for _ in range(settings.repeats):
            began = time.perf_counter()
            data = fetcher.fetch(lease.lease_id, lease.size_bytes, lease.crc32, "bench")
            fetch_times.append(time.perf_counter() - began)
        fetch_mb_s = lease.size_bytes / median(fetch_times) / 1e6
        raw_mb_s = _raw_socket_mb_s(data, settings.repeats)
        bare_times = []
        for _ in range(settings.repeats):
            began = time.perf_counter()
            request = pb.FetchFileRequest(lease_id=lease.lease_id, client_id=client_id)
            for _chunk in rpc.stream("FetchFile", request, timeout_s=60):
                pass
            bare_times.append(time.perf_counter() - began)
        bare_mb_s = lease.size_bytes / median(bare_times) / 1e6
    finally:
        rpc.call(
            "ReleaseLease",
            pb.ReleaseLeaseRequest(
                lease_id=lease.lease_id, client_id=client_id, outcome=pb.RETURNED
            ),
        )
        rpc.close()
    ratio = fetch_mb_s / raw_mb_s
    return [
        Result(
            "9",
            f"FetchFile of a {lease.size_bytes / 1e6:.1f} MB file",
            fetch_mb_s,
            "MB/s",
            "raw loopback TCP",
            raw_mb_s,
            "MB/s",
            ratio,
            "x raw socket",
            goal=f">= {FETCH_GOAL}x",
            met=ratio >= FETCH_GOAL,
        ),
        Result(
            "9",
            f"FetchFile of a {lease.size_bytes / 1e6:.1f} MB file",
            fetch_mb_s,
            "MB/s",
            "bare gRPC stream of it",
            bare_mb_s,
            "MB/s",
            fetch_mb_s / bare_mb_s,
            "x the bare stream",
        ),
    ]


def _read_files_us(server: Server, dataset: str, transport: str, files: int, nb: int) -> float:
    """µs per batch over `files` whole files after the first, boundaries included."""
    from queue_client import QueueClient

    with QueueClient(
        server.address, dataset, transport=transport, data_root=server.data_root
    ) as client:
        for _ in range(nb):  # the first file: start-up, not steady state
            client.get_batch("train")
        n = files * nb
        began = time.perf_counter_ns()
        for _ in range(n):
            client.get_batch("train")
        return (time.perf_counter_ns() - began) / n / 1e3


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    server = found["transport"]
    results = _fetch_rows(settings, server)
    nb = settings.pick(100, 4)
    files = settings.pick(6, 2)
    grpc_us = _read_files_us(server, "net_grpc", "grpc", files, nb)
    file_us = _read_files_us(server, "net_file", "file", files, nb)
    b, t = SHAPE
    n = settings.pick(200, 5)
    began = time.perf_counter_ns()
    for _ in range(n):
        baselines.nanogpt_get_batch(tokens.train_bin, b, t)
    nano_us = (time.perf_counter_ns() - began) / n / 1e3
    shape = f"B={b}, T={t}, {files} files"
    results.append(
        Result(
            "9",
            f"get_batch over grpc ({shape})",
            grpc_us,
            "µs/batch",
            "file transport",
            file_us,
            "µs/batch",
            grpc_us / file_us,
            "x file's time",
        )
    )
    results.append(
        Result(
            "9",
            f"get_batch over grpc ({shape})",
            grpc_us,
            "µs/batch",
            "nanoGPT get_batch",
            nano_us,
            "µs/batch",
            nano_us / grpc_us,
            "x faster",
        )
    )
    return results
