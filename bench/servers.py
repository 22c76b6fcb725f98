"""Queue servers the suite starts and stops itself: a config it writes, a port chosen by the
kernel (or a unix socket in a short temp dir), a ready file, then SERVING on the health service.

`loop="cli"` runs the real `queue-server` entry point (always uvloop); "uvloop" and "asyncio"
run the same `create_server` under the named event loop (bench/loop_server.py), for row 4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import memory_mb
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.testing import SERVER_COMMAND, ServerProcess

REPO = Path(__file__).resolve().parent.parent
_START_TIMEOUT_S = 180.0


def dataset_toml(
    name: str,
    *,
    text: Path,
    batch_size: int,
    block_size: int,
    batches_per_file: int = 100,
    backlog: int = 2,
    workers: int = 1,
    worker_priority: str = "normal",
) -> str:
    """A char_lm dataset over `text`: B random windows of T tokens per batch, as nanoGPT draws."""
    return (
        f"[datasets.{name}]\n"
        'provider = "char_lm"\n'
        f"batch_size = {batch_size}\n"
        f"batches_per_file = {batches_per_file}\n"
        f"max_backlog_files = {backlog}\n"
        f"workers = {workers}\n"
        + (f'worker_priority = "{worker_priority}"\n' if worker_priority != "normal" else "")
        + f"[datasets.{name}.args]\n"
        f"input = {json.dumps(str(text))}\n"
        f"block_size = {block_size}\n"
    )


def server_toml(datasets: list[str]) -> str:
    """The [server] table plus datasets. Metrics, where the server has them, bind a free port
    so that several servers can run side by side."""
    from queue_server.config.server import ServerConfig

    lines = ["[server]", "lease_ttl_s = 60"]
    if "metrics_listen" in {f.name for f in dataclasses.fields(ServerConfig)}:
        lines.append('metrics_listen = "127.0.0.1:0"')
    return "\n".join(lines) + "\n\n" + "\n".join(datasets)


@dataclass(frozen=True)
class ServerSpec:
    key: str
    datasets: tuple[str, ...]  # dataset_toml() tables
    transport: str = "tcp"  # or "unix"
    loop: str = "cli"  # or "uvloop", "asyncio"

    @property
    def config(self) -> str:
        return server_toml(list(self.datasets))


def child_env() -> dict[str, str]:
    """The environment for servers and helper processes: the repo root importable (for
    bench.*), gRPC quiet, and no fork handlers (workers are fork+exec'd anyway)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    return env


class Server(ServerProcess):
    """A running server of one spec, in its own directory under the work dir."""

    def __init__(self, spec: ServerSpec, workdir: Path) -> None:
        self.spec = spec
        # A socket path must stay short (108 bytes on Linux): its own dir in the system temp dir.
        self._socket_dir = (
            Path(tempfile.mkdtemp(prefix="bqs-")) if spec.transport == "unix" else None
        )
        listen = f"unix:{self._socket_dir / 's.sock'}" if self._socket_dir else "127.0.0.1:0"
        if spec.loop == "cli":
            command: tuple[str, ...] = SERVER_COMMAND
        else:
            command = (sys.executable, "-m", "bench.loop_server", "--loop", spec.loop)
        home = workdir / f"server-{spec.key}"
        super().__init__(
            home,
            data_root=home / "data",
            config_text=spec.config,
            listen=listen,
            command=command,
            env=child_env(),
            metrics_listen=None,  # server_toml's [server] table picks a free port
        )

    def worker_pids(self, dataset: str) -> list[int]:
        reply = self.stub.GetStats(pb.GetStatsRequest(dataset=dataset), timeout=10)
        return [int(p) for s in reply.splits for p in s.worker_pids]

    def memory(self) -> dict[str, float] | None:
        return memory_mb(self.pid)

    def stop(self, timeout_s: float = 30.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            if self._socket_dir is not None:
                shutil.rmtree(self._socket_dir, ignore_errors=True)


def start_all(specs: list[ServerSpec], workdir: Path, *, merge: bool = False) -> dict[str, Server]:
    """Start every server at once (their start-ups overlap), then wait for each to serve.

    With `merge` (the smoke version, where nothing is timed for real), every spec that the
    plain CLI can serve (TCP, uvloop) shares one server: fewer start-ups on a small machine.
    Returns spec key -> server; stop each distinct server once (stop_all)."""
    if merge:
        shared = [s for s in specs if s.transport == "tcp" and s.loop in ("cli", "uvloop")]
        if len(shared) > 1:
            datasets = tuple(dict.fromkeys(d for s in shared for d in s.datasets))
            merged = ServerSpec("shared", datasets)
            specs = [merged] + [s for s in specs if s not in shared]
            alias = {s.key: "shared" for s in shared}
        else:
            alias = {}
    else:
        alias = {}
    servers = {s.key: Server(s, workdir) for s in specs}
    began = time.monotonic()
    try:
        for server in servers.values():
            server.wait_serving(max(10.0, _START_TIMEOUT_S - (time.monotonic() - began)))
    except BaseException:
        stop_all(servers)
        raise
    for key, target in alias.items():
        servers[key] = servers[target]
    return servers


def stop_all(servers: dict[str, Server]) -> None:
    """Stop each distinct server; one that hangs on shutdown is killed and reported after
    the others have stopped."""
    failed: list[BaseException] = []
    for server in {id(s): s for s in servers.values()}.values():
        try:
            server.stop()
        except TimeoutError as exc:
            failed.append(exc)
    if failed:
        raise failed[0]
