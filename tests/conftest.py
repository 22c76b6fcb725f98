"""Shared fixtures: a real queue-server process on a free port or a unix socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"


def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition"
) -> Any:
    """Poll `predicate` until it returns something truthy, or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def train_losses(
    client: Any, params: Any, loss_of: Callable[[Any], Any], lr: float, steps: int = 30
) -> list[float]:
    """Adam on `params` over `steps` train batches of `client`, each checked against the
    split's schema first; the losses, to show a tiny model learns through the queue."""
    import torch

    from queue_client.schema import check_tensors

    opt = torch.optim.Adam(params, lr=lr)
    names = [f.name for f in client.schema("train")]
    losses = []
    for _ in range(steps):
        batch = client.get_batch("train")
        fields = dict(zip(names, batch, strict=True)) if isinstance(batch, tuple) else batch
        check_tensors(client.schema("train"), fields, (client.batch_size,))
        loss = loss_of(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "providers"), str(SUPPORT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env.update(extra)
    return env


def tiny_corpus(path: Path, chars: int = 40_000) -> Path:
    """A small deterministic text corpus, written by the test itself."""
    words = ["alpha", "beta", "gamma", "delta", "queue", "batch", "lease", "file", "rank", "seq"]
    out, i = [], 0
    while sum(len(w) + 1 for w in out) < chars:
        out.append(words[(i * 7 + i // 3) % len(words)])
        i += 1
    path.write_text(" ".join(out) + "\n", encoding="utf-8")
    return path


def char_config(
    corpus: Path,
    *,
    name: str = "chars",
    batch_size: int = 4,
    block_size: int = 16,
    batches_per_file: int = 5,
    extra: str = "",
    server: str = "lease_ttl_s = 30",
) -> str:
    return textwrap.dedent(
        f"""
        [server]
        {server}
        [datasets.{name}]
        provider = "char_lm"
        batch_size = {batch_size}
        batches_per_file = {batches_per_file}
        {extra}
        [datasets.{name}.args]
        input = "{corpus.as_posix()}"
        block_size = {block_size}
        """
    )


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    address: str
    data_root: Path
    config_path: Path | None
    log_path: Path
    metrics_address: str = ""
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> pb_grpc.BatchQueueStub:
        return pb_grpc.BatchQueueStub(self.channel)

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status

    def stats(self, dataset: str) -> dict[str, Any]:
        reply = self.stub.GetStats(pb.GetStatsRequest(dataset=dataset), timeout=30)
        return MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    def split_stats(self, dataset: str, split: str = "train") -> dict[str, Any]:
        for s in self.stats(dataset)["splits"]:
            if s["split"] == split:
                return {
                    k: (int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v)
                    for k, v in s.items()
                }
        raise KeyError(split)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class ServerFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.servers: list[ServerProcess] = []
        self._n = 0

    def __call__(
        self,
        config_text: str | None = None,
        *,
        data_root: Path | None = None,
        listen: str = "127.0.0.1:0",
        wait_serving: bool = True,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> ServerProcess:
        self._n += 1
        work = self.tmp_path / f"server{self._n}"
        work.mkdir(parents=True, exist_ok=True)
        data_root = data_root or self.tmp_path / "data"
        config_path = None
        cmd = [
            sys.executable,
            "-m",
            "queue_server",
            "--listen",
            listen,
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-root",
            str(data_root),
            "--ready-file",
            str(work / "ready.json"),
            *args,
        ]
        if config_text is not None:
            config_path = work / "config.toml"
            config_path.write_text(config_text, encoding="utf-8")
            cmd += ["--config", str(config_path)]
        log_path = work / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=subprocess_env(**(env or {})),
                cwd=work,
            )
        ready = work / "ready.json"

        def bound() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"queue-server exited with {proc.returncode}:\n{log_path.read_text()}"
                )
            return ready.exists()

        wait_until(bound, timeout_s, "the server to bind")
        info = json.loads(ready.read_text())
        server = ServerProcess(
            proc,
            info["address"],
            data_root,
            config_path,
            log_path,
            metrics_address=info.get("metrics_address", ""),
        )
        self.servers.append(server)
        if wait_serving:
            wait_until(
                lambda: server.health() == health_pb2.HealthCheckResponse.SERVING,
                timeout_s,
                f"SERVING\n{server.log()}",
            )
        return server

    def close(self) -> None:
        for server in self.servers:
            try:
                server.kill(signal.SIGKILL)
            except Exception:
                pass


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """start_server(config_text) -> ServerProcess; every server is killed at teardown."""
    factory = ServerFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return tiny_corpus(tmp_path / "corpus.txt")


def run_client_script(
    code: str, *, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a client in its own process (a real trainer would be one); fails the test on error."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=subprocess_env(**(env or {})),
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"client process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc
