"""The server's lifecycle: create and bind, serve, then a staged shutdown.

Shutdown order: health goes NOT_SERVING (load balancers and probes stop sending work), the
gRPC server stops with a grace period (calls in flight finish), then the datasets stop their
worker processes and close their journals, and last the temp files of interrupted writes by
those (now stopped) workers are removed, so a stopped server leaves no temp file behind.

The server says what it does without -v: one line when it listens, one per dataset once that
serves (its splits, workers per split, backend and address), and the failure of a dataset.
`failure` is set when a dataset fails; the CLI decides whether that stops the server.

At start the server also reads its TLS certificate and key (when configured; the TCP
listener then speaks TLS only) and the data root's id, made on first use, which GetMeta
publishes so that a client can tell whether it sees this very root or must stream files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import uuid
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from queue_client.errors import ConfigError
from queue_client.format.layout import atomic_write, root_id_file
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.config.server import ServerConfig, parse_listen
from queue_server.dataset import FAILED, SERVING, DatasetRuntime
from queue_server.host.root_lock import DataRootLock
from queue_server.host.tcp_port import check_free, listen_error
from queue_server.host.temp_sweep import remove_orphan_temp_files
from queue_server.host.unix_socket import claim_socket_path, remove_socket, socket_identity
from queue_server.production.forkserver_start import start_forkserver
from queue_server.production.ray import ray_connect
from queue_server.production.worker_imports import datasets_need_torch
from queue_server.rpc.auth import TokenInterceptor
from queue_server.rpc.fetch_streams import FetchStreams
from queue_server.rpc.metrics import MetricsServer
from queue_server.rpc.request_decoding import DecodingGuard, add_servicer
from queue_server.rpc.servicer import BatchQueueServicer
from queue_server.split.leases import LeaseDirectory
from queue_server.split.queue import SplitQueue

log = logging.getLogger("queue_server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BatchQueue"].full_name
# Requests are small; anything near this is abuse. Replies carry meta, which may hold a vocab.
MAX_RECEIVE_BYTES = 4 * 1024 * 1024
MAX_SEND_BYTES = 64 * 1024 * 1024


_ROOT_ID_RE = re.compile(r"[0-9a-f]{32}")


def ensure_root_id(root: Path) -> str:
    """The data root's random id, made and written (atomically) the first time."""
    path = root_id_file(root)
    try:
        found = path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        found = ""
    if _ROOT_ID_RE.fullmatch(found):
        return found
    made = uuid.uuid4().hex
    atomic_write(path, f"{made}\n".encode())
    return made


def _read_pem(key: str, path: str, marker: bytes) -> bytes:
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"server.{key} = {path!r} cannot be read: {exc.strerror}") from None
    if marker not in pem:
        raise ConfigError(f"server.{key} = {path!r} is not a PEM file with {marker.decode()}")
    return pem


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from server.tls_cert_file and tls_key_file; None without them."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    cert = _read_pem("tls_cert_file", str(config.tls_cert_file), b"-----BEGIN CERTIFICATE-----")
    key = _read_pem("tls_key_file", str(config.tls_key_file), b"PRIVATE KEY-----")
    return grpc.ssl_server_credentials([(key, cert)])


def describe_serving(runtime: DatasetRuntime, address: str) -> str:
    """The line a dataset logs once it serves: its splits, workers per split, backend, address."""
    config = runtime.config
    splits = list(runtime.meta.get("split_info", ()))
    curriculum = set(config.curriculum.splits) if config.selection == "curriculum" else set()
    parts = []
    for split in splits:
        n = config.workers_for(split, splits)
        how = f"{n} worker{'s' if n != 1 else ''}" + (", curriculum" if split in curriculum else "")
        how += ", started on its first lease" if runtime.lazy_split(split) else ""
        parts.append(f"{split} ({how})")
    backend = config.backend + (f" at {config.ray_address}" if config.backend == "ray" else "")
    return (
        f"dataset {runtime.name} serving on {address}: splits {', '.join(parts) or 'none'}; "
        f"backend {backend}"
    )


def health_name(dataset: str) -> str:
    """The health service name of one dataset: NOT_SERVING while it starts or after it failed.
    The dataset's bare name answers the same (a probe's `--service NAME`)."""
    return f"{SERVICE_NAME}/{dataset}"


class QueueServer:
    def __init__(self, config: ServerConfig) -> None:
        root = Path(config.data_root).expanduser().resolve()
        self.config = replace(config, data_root=root)
        self.health = health.aio.HealthServicer()
        # FetchFile streams: the server-wide cap, and each one ended with its lease.
        self.streams = FetchStreams(self.config.max_fetch_streams)
        self.leases: LeaseDirectory[SplitQueue] = LeaseDirectory(self.streams.lease_ended)
        self.datasets = {
            d.name: DatasetRuntime(d, self.config, self._on_dataset_state, self.leases)
            for d in config.datasets
        }
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address = ""
        self._unix_socket: tuple[int, int] | None = None  # (dev, inode) of the socket we bound
        self.metrics = (
            MetricsServer(self.datasets, self.config.metrics_listen, self.streams)
            if self.config.metrics_listen
            else None
        )
        self.metrics_address = ""
        self._root_lock = DataRootLock(root)
        self.root_id = ""
        # Datasets that failed, in order, and whether any did: the CLI stops on it by default.
        self.failed: list[DatasetRuntime] = []
        self.failure = asyncio.Event()
        self.served_once: set[str] = set()  # datasets that reached SERVING at least once

    def _on_dataset_state(self, runtime: DatasetRuntime) -> None:
        if runtime.state == SERVING and runtime.name not in self.served_once:
            self.served_once.add(runtime.name)
            log.info("%s", describe_serving(runtime, self.address))
        if runtime.state == FAILED and runtime not in self.failed:
            self.failed.append(runtime)
            self.failure.set()
        asyncio.get_running_loop().create_task(self._publish_health())

    async def _publish_health(self) -> None:
        states = [rt.state for rt in self.datasets.values()]
        overall = all(s == SERVING for s in states)
        status = health_pb2.HealthCheckResponse
        for name, rt in self.datasets.items():
            one = status.SERVING if rt.state == SERVING else status.NOT_SERVING
            for service in (health_name(name), name):
                await self.health.set(service, one)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status.SERVING if overall else status.NOT_SERVING)

    async def start(self) -> str:
        """Bind, start serving, and start every dataset in the background; returns the address."""
        cfg = self.config
        listen = parse_listen(cfg.listen)
        if listen.host is not None and listen.port is not None:
            await asyncio.to_thread(check_free, listen.host, listen.port, cfg.listen)
        credentials = await asyncio.to_thread(server_credentials, cfg)
        await asyncio.to_thread(self._root_lock.acquire)  # before anything touches the root
        # Workers fork from a forkserver (that imports torch where they need it): it starts now,
        # beside our own start, unless the command started it already.
        preload_torch = datasets_need_torch((d.provider, d.args) for d in cfg.datasets)
        await asyncio.to_thread(start_forkserver, preload_torch)
        self.root_id = await asyncio.to_thread(ensure_root_id, cfg.data_root)
        if not listen.is_loopback:
            log.warning(
                "listening on %s, which is reachable from other hosts%s",
                cfg.listen,
                ""
                if cfg.auth_token
                else "; set server.auth_token so that only your trainers can lease files",
            )
        interceptors = [TokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        servicer = BatchQueueServicer(
            self.datasets,
            self.leases,
            str(cfg.data_root),
            cfg.lease_ttl_s,
            cfg.acquire_wait_s,
            self.metrics,
            data_root_id=self.root_id,
            streams=self.streams,
        )
        add_servicer(servicer, server)
        # The standard services through DecodingGuard, so that bytes that are no request
        # are INVALID_ARGUMENT there too (rpc/request_decoding.py).
        guard = DecodingGuard(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, guard)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(
                (
                    SERVICE_NAME,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                )
            ),
            guard,
        )
        if listen.unix_path:
            await asyncio.to_thread(claim_socket_path, listen.unix_path)
            old = os.umask(0o777 & ~cfg.unix_socket_mode)  # the socket is born with its final mode
            try:
                server.add_insecure_port(listen.grpc_target)
            finally:
                os.umask(old)
            self._unix_socket = await asyncio.to_thread(socket_identity, listen.unix_path)
            self.address = listen.grpc_target
        else:
            try:
                port = (
                    server.add_secure_port(listen.grpc_target, credentials)
                    if credentials is not None
                    else server.add_insecure_port(listen.grpc_target)
                )
            except RuntimeError:  # gRPC's bind failure, which names no cause
                port = 0
            if port == 0:
                raise listen_error(cfg.listen, "the address is in use or not available")
            self.address = f"{listen.host}:{port}"
        await self._publish_health()
        if self.metrics is not None:
            self.metrics_address = await self.metrics.start()
        await server.start()
        self._server = server
        for runtime in self.datasets.values():
            self._tasks.append(asyncio.get_running_loop().create_task(runtime.start()))
        log.info(
            "batchqueue listening on %s%s for datasets %s (data root %s%s); each dataset "
            "logs a line once it serves",
            self.address,
            " with TLS" if credentials is not None else "",
            ", ".join(sorted(self.datasets)),
            cfg.data_root,
            f", /metrics and /healthz on {self.metrics_address}" if self.metrics_address else "",
        )
        return self.address

    async def wait_ready(self) -> None:
        await asyncio.gather(*(rt.ready.wait() for rt in self.datasets.values()))

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.metrics is not None:
            await self.metrics.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(rt.close() for rt in self.datasets.values()), return_exceptions=True)
        # After every actor is stopped; a "local" Ray instance stops here too.
        await asyncio.to_thread(ray_connect.disconnect)
        # Every worker is stopped and reaped now: what its interrupted writes left can go.
        removed = await asyncio.to_thread(
            remove_orphan_temp_files, [rt.dir for rt in self.datasets.values()]
        )
        if removed:
            log.info("removed %d temp file(s) of writes that the stop interrupted", removed)
        listen = parse_listen(self.config.listen)
        if listen.unix_path:
            await asyncio.to_thread(remove_socket, listen.unix_path, self._unix_socket)
        self._root_lock.release()


async def create_server(config: ServerConfig) -> tuple[QueueServer, str]:
    """Start a server; returns it and the address it is bound to (port 0 picks a free one)."""
    server = QueueServer(config)
    address = await server.start()
    return server, address
