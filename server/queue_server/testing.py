"""Real queue-server processes for the test suite and the benchmarks.

    server = ServerProcess(workdir, data_root=workdir / "data", config_text=toml)
    server.wait_serving()
    ...  # QueueClient(server.address, ...), server.split_stats("chars"), ...
    server.stop()

Each server is the real entry point in its own process, on a port the kernel picks (or a unix
socket): a test or a benchmark then exercises exactly what ships, and learns the address from
the ready file the server writes once it listens. Its output goes to a log file in `workdir`,
and a server that exits while starting raises ServerExited with that log.

Users never need this module: a trainer talks to a server through queue_client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc
from queue_server.host.parent_watch import ParentPipe

T = TypeVar("T")

SERVER_COMMAND = (sys.executable, "-m", "queue_server")
# What a server started here keeps in its work dir (never under the data root).
READY_FILE = "ready.json"
LOG_FILE = "server.log"
CONFIG_FILE = "config.toml"

# Every server started in this process, so that a failed test can say which of them ended
# on its own (tests/conftest.py adds that to the failure report).
_STARTED: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class ServerExited(RuntimeError):
    """The server process ended while it was expected to start; the message holds its log."""


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 30.0,
    what: str = "condition",
    *,
    poll_s: float = 0.02,
) -> T:
    """Poll `predicate` until it returns something truthy and return that, or raise
    TimeoutError naming `what`. For state in another process, which sends no event here."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)


def _digits_to_int(value: Any) -> Any:
    """JSON renders int64 fields as strings; give them back as ints."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


class ServerProcess:
    """A queue-server process, started on construction; the address is known once it binds.

    `command` is the entry point without flags (a benchmark runs the same app under another
    event loop); the flags --listen, --data-root, --ready-file and --config are added here,
    then `args`. `env` is the process's whole environment (default: this one's).
    `metrics_listen` is where /metrics and /healthz go: by default a port the kernel picks,
    so that servers started side by side never race for the fixed default port (None leaves
    it to the config or the server's default).
    `keep_serving` adds --keep-serving: a failed dataset is reported, not an exit with code 2.
    `own_process_group` starts it in a process group of its own (with its workers), so that
    `signal_group` can send a signal to all of them, as a terminal's Ctrl-C does.
    `pass_fds` are descriptors the process inherits (as subprocess.Popen's pass_fds).
    `stop_with_parent` adds --parent-pipe: the server stops once this process has ended,
    however it ended, so a test run or a benchmark that is killed leaves no server behind.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        data_root: Path,
        config_text: str | None = None,
        listen: str = "127.0.0.1:0",
        args: Sequence[str] = (),
        command: Sequence[str] = SERVER_COMMAND,
        env: Mapping[str, str] | None = None,
        keep_serving: bool = False,
        own_process_group: bool = False,
        metrics_listen: str | None = "127.0.0.1:0",
        pass_fds: Sequence[int] = (),
        stop_with_parent: bool = True,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.data_root = data_root
        self.ready_file = workdir / READY_FILE
        self.ready_file.unlink(missing_ok=True)  # one left by an earlier server names its address
        self.log_path = workdir / LOG_FILE
        self.config_path: Path | None = None
        cmd = [*command, "--listen", listen, "--data-root", str(data_root)]
        cmd += ["--ready-file", str(self.ready_file)]
        if config_text is not None:
            self.config_path = workdir / CONFIG_FILE
            self.config_path.write_text(config_text, encoding="utf-8")
            cmd += ["--config", str(self.config_path)]
        if keep_serving:
            cmd.append("--keep-serving")
        if metrics_listen is not None and "--metrics-listen" not in args:
            cmd += ["--metrics-listen", metrics_listen]
        cmd += args
        self._parent_pipe: ParentPipe | None = None
        if stop_with_parent and "--parent-pipe" not in args:
            self._parent_pipe = ParentPipe()
            cmd += ["--parent-pipe", str(self._parent_pipe.read_fd)]
            pass_fds = (*pass_fds, self._parent_pipe.read_fd)
        if env is None:
            env = {**os.environ, "GRPC_VERBOSITY": os.environ.get("GRPC_VERBOSITY", "ERROR")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=workdir,
                start_new_session=own_process_group,
                pass_fds=tuple(pass_fds),
            )
        if self._parent_pipe is not None:
            self._parent_pipe.child_started()
        self.pid = self.proc.pid
        self.signalled = False  # set once this process sends it a signal
        self._exit_reported = False
        _STARTED.add(self)
        self.address = ""  # set by wait_bound
        self.metrics_address = ""
        self._channel: grpc.Channel | None = None

    # ---- start -----------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise ServerExited(
                f"queue-server (pid {self.pid}) exited with {self.proc.returncode}:\n{self.log()}"
            )

    def wait_bound(self, timeout_s: float = 60.0) -> None:
        """Wait for the ready file, then read the address (and metrics address) from it."""

        def bound() -> bool:
            self._check_running()
            return self.ready_file.exists()

        wait_until(bound, timeout_s, f"queue-server pid {self.pid} to bind")
        info = json.loads(self.ready_file.read_text(encoding="utf-8"))
        self.address = info["address"]
        self.metrics_address = info.get("metrics_address", "")

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Wait until bound and the health service says SERVING (every dataset started)."""
        began = time.monotonic()
        if not self.address:
            self.wait_bound(timeout_s)

        def serving() -> bool:
            self._check_running()
            try:
                return self.health() == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:  # not accepting calls yet
                    return False
                raise

        left = max(1.0, timeout_s - (time.monotonic() - began))
        try:
            wait_until(serving, left, f"queue-server at {self.address} to serve", poll_s=0.05)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; its log ends:\n{self.log_tail()}") from None

    # ---- looking inside ----------------------------------------------------------------------
    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> pb_grpc.BatchQueueStub:
        return pb_grpc.BatchQueueStub(self.channel)

    def health(self, service: str = "") -> int:
        """The health service's status for `service` ("" is the whole server)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status)

    def stats(self, dataset: str) -> dict[str, Any]:
        """GetStats of `dataset`, as a dict with the proto's field names."""
        reply = self.stub.GetStats(pb.GetStatsRequest(dataset=dataset), timeout=30)
        return MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    def split_stats(self, dataset: str, split: str = "train") -> dict[str, Any]:
        """One split's entry of stats(), its counters as ints."""
        for s in self.stats(dataset)["splits"]:
            if s["split"] == split:
                return {k: _digits_to_int(v) for k, v in s.items()}
        raise KeyError(f"dataset {dataset!r} has no split {split!r}")

    def wait_ready_files(
        self, dataset: str, count: int, split: str = "train", timeout_s: float = 120.0
    ) -> None:
        """Wait until `count` files wait unleased: the provider has filled its backlog."""
        wait_until(
            lambda: self.split_stats(dataset, split)["ready_files"] >= count,
            timeout_s,
            f"{count} ready files of {dataset}/{split}",
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    # ---- stop --------------------------------------------------------------------------------
    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> None:
        """Send `sig` (if it still runs) and wait for the process to end."""
        self.close_channel()
        self.signalled = True
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout_s)
        self._release_parent_pipe()

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the server's whole process group (started with own_process_group),
        workers included, as a terminal does on Ctrl-C."""
        if os.getpgid(self.pid) != self.pid:
            raise RuntimeError("signal_group needs a server started with own_process_group=True")
        self.signalled = True
        os.killpg(self.pid, sig)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """Wait for the process to end by itself; its exit code. TimeoutError names the log."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"queue-server pid {self.pid} still runs after {timeout_s:g}s:\n{self.log_tail()}"
            ) from None
        self._release_parent_pipe()
        return code

    def _release_parent_pipe(self) -> None:
        """The process has ended: close our end of its --parent-pipe."""
        if self._parent_pipe is not None:
            self._parent_pipe.close()
            self._parent_pipe = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down gracefully (SIGTERM). A server still running after timeout_s is killed,
        and TimeoutError says so: a shutdown that hangs is a bug, not something to wait out."""
        try:
            self.kill(signal.SIGTERM, timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
            self._release_parent_pipe()
            raise TimeoutError(
                f"queue-server pid {self.pid} did not stop within {timeout_s:g}s of SIGTERM and "
                f"was killed:\n{self.log_tail()}"
            ) from None


__all__ = [
    "CONFIG_FILE",
    "LOG_FILE",
    "READY_FILE",
    "SERVER_COMMAND",
    "ServerExited",
    "ServerProcess",
    "wait_until",
]


def unexpected_exits() -> list[str]:
    """Servers started here that ended with a failure code although nothing here signalled
    them, each once: their pid, exit code and the end of their log. A test that fails because
    its server went away then says why, instead of only "connection refused"."""
    found = []
    for server in list(_STARTED):
        code = server.proc.poll()
        if code in (None, 0) or server.signalled or server._exit_reported:
            continue
        server._exit_reported = True
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        found.append(f"queue-server pid {server.pid} ended by {how}:\n{server.log_tail(40)}")
    return found
