"""A queue-server for the length of a `with` block: quick starts, notebooks, tests of a trainer.

    from queue_server import serve
    from queue_client import QueueClient

    with serve("my.toml") as address:          # or a TOML string, or ServerConfig/DatasetConfig
        client = QueueClient(address, "web")
        batch = client.get_batch("train")

The server is a child process, not threads of the caller: its providers' CPU work and its
event loop never hold the caller's GIL, and a notebook's own event loop is never touched (the
API is synchronous and runs no asyncio; `serve_async` is the same for `async with`). It listens
on a free loopback port (or a private unix socket), and `serve` returns once the health service
says SERVING, that is once every dataset has started. A config that does not validate raises
ConfigError in the caller before anything starts; an error of the server while starting (a
missing corpus, a dataset that failed) raises in the caller with the server's own message. A
dataset whose meta is built serves before its workers start and its inputs are checked
(dataset.py): a changed input then fails its first lease with the server's message instead. On exit the server is stopped gracefully (SIGTERM: leases end, workers stop,
journals are closed), so the data root is left as a restarted server expects it.

The server also ends with its caller: it watches a pipe whose only write end the caller holds
(parent_watch.py), so a caller that dies without leaving the block (SIGKILL, a crash) closes
it, and the server stops the same graceful way, then removes its private folder. No orphan
keeps the port, the workers, or the data root's lock.

`python -m queue_server.serve_child --spec SPEC.json ...` is the child's entry point (it starts
the workers' forkserver before its own imports, as `queue-server` does), and it is
`queue-server` itself: the config crosses as the plain tables of a TOML file (config/tables.py)
plus the folder that relative paths are relative to, so a config that never was a file keeps
its meaning.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Union

import grpc
from grpc_health.v1 import health_pb2

from queue_client.errors import ConfigError
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.config.server import DatasetConfig, ServerConfig, parse_config
from queue_server.config.tables import check_json, server_tables
from queue_server.dataset import FAILED
from queue_server.host.parent_watch import ParentPipe, stop_with_parent
from queue_server.testing import ServerExited, ServerProcess, wait_until

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ConfigSource = Union[str, "os.PathLike[str]", ServerConfig, DatasetConfig, Sequence[DatasetConfig]]

CHILD_COMMAND = (sys.executable, "-m", "queue_server.serve_child")
SPEC_FILE = "spec.json"
SOCKET_FILE = "queue.sock"
# How the server's entry point starts the line that says why it exits (a config error: 2).
_SAID = "queue-server: "
_CONFIG_ERROR = _SAID + "config error: "
# How long a server whose dataset failed gets to stop and print its reason.
_EXIT_AFTER_FAILURE_S = 30.0


class ServeError(RuntimeError):
    """The server did not start (a dataset failed, it exited, or it timed out): the server's
    own message, or its log when it ended without one."""


# ---- the config, in the caller -----------------------------------------------------------------


def _tables_of(config: ConfigSource) -> tuple[dict[str, Any], Path]:
    """The config's tables and the folder its relative paths are relative to. Validated here,
    so a bad config raises ConfigError in the caller, naming the key."""
    if isinstance(config, ServerConfig):
        base = Path(config.config_dir).expanduser().resolve()
        return server_tables(replace(config, config_dir=base)), base
    if isinstance(config, DatasetConfig):
        config = [config]
    if isinstance(config, (list, tuple)):
        if not all(isinstance(d, DatasetConfig) for d in config):
            raise ConfigError("serve() takes DatasetConfig objects in a list, or a ServerConfig")
        return _tables_of(ServerConfig(config_dir=Path.cwd(), datasets=tuple(config)))
    if isinstance(config, os.PathLike) or (isinstance(config, str) and _is_path(config)):
        path = Path(config).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        return _parse_text(text, str(path)), path.resolve().parent
    if isinstance(config, str):
        return _parse_text(config, "the config string"), Path.cwd()
    raise ConfigError(
        "serve() takes a TOML file path, a TOML string, a ServerConfig, or DatasetConfig "
        f"objects; got {type(config).__name__}"
    )


def _is_path(text: str) -> bool:
    """A string of one line without `=` or `[` is a path (no TOML config is one); any other
    string is TOML text."""
    return bool(text) and not any(c in text for c in "\n=[")


def _parse_text(text: str, where: str) -> dict[str, Any]:
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    check_json(tables)
    return tables


def _prepare(
    config: ConfigSource, workdir: Path, data_root: str | os.PathLike[str] | None, verbose: bool
) -> tuple[ServerConfig, Path]:
    """The validated config and the spec file the child reads it from."""
    tables, base = _tables_of(config)
    parsed = parse_config(tables, config_dir=base)
    root = Path(data_root).expanduser().resolve() if data_root is not None else parsed.data_root
    spec = workdir / SPEC_FILE
    spec.write_text(
        json.dumps({"tables": tables, "config_dir": os.fspath(base), "verbose": verbose}),
        encoding="utf-8",
    )
    return replace(parsed, data_root=Path(root).resolve()), spec


# ---- start, wait, stop ---------------------------------------------------------------------


def _server_message(exited: ServerExited) -> Exception:
    """The server's reason, from the line its entry point prints before it exits: a
    ConfigError for a config error, else ServeError (with the log when there is no such
    line, a crash)."""
    lines = str(exited).splitlines()
    for line in reversed(lines):
        if line.startswith(_CONFIG_ERROR):
            return ConfigError(line[len(_CONFIG_ERROR) :])
        if line.startswith(_SAID):
            return ServeError(line[len(_SAID) :])
    return ServeError("\n".join(lines))


def _failed_dataset(server: ServerProcess, names: Sequence[str]) -> str | None:
    """`name: last error` of the first dataset that failed, None while none has."""
    for name in names:
        try:
            reply = server.stub.GetStats(pb.GetStatsRequest(dataset=name), timeout=10)
        except grpc.RpcError:
            return None
        if reply.state == FAILED:
            return f"dataset {name!r} failed to start: {reply.last_error}"
    return None


def _exited(server: ServerProcess) -> ServerExited:
    return ServerExited(
        f"queue-server (pid {server.pid}) exited with {server.proc.returncode}:\n{server.log()}"
    )


def _wait_started(server: ServerProcess, names: Sequence[str], timeout_s: float) -> None:
    """Until every dataset serves; raises with the server's reason if it cannot."""
    try:
        server.wait_bound(timeout_s)

        def settled() -> str | bool:
            if server.proc.poll() is not None:
                raise _exited(server)
            try:
                if server.health() == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:  # not accepting calls yet, or stopping (the next poll says)
                return False
            return _failed_dataset(server, names) or False

        outcome = wait_until(settled, timeout_s, f"queue-server at {server.address} to serve")
    except ServerExited as exited:
        raise _server_message(exited) from None
    except TimeoutError as exc:
        raise ServeError(f"{exc}; its log ends:\n{server.log_tail()}") from None
    if isinstance(outcome, str):
        # A dataset failed. The server stops for it and says why (a config error or not),
        # unless server.keep_serving keeps it up: then the dataset's own error is the reason.
        try:
            server.proc.wait(timeout=_EXIT_AFTER_FAILURE_S)
        except subprocess.TimeoutExpired:
            raise ServeError(outcome) from None
        raise _server_message(_exited(server)) from None


@contextlib.contextmanager
def serve(
    config: ConfigSource,
    *,
    data_root: str | os.PathLike[str] | None = None,
    listen: str | None = None,
    unix_socket: bool = False,
    metrics_listen: str = "",
    verbose: bool = False,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """Serve `config` from a child process for the `with` block; yields its address.

    config: a TOML file path, a TOML string (relative paths then resolve from the current
    folder), a ServerConfig, or one or more DatasetConfig. data_root overrides the config's.
    listen: default a free port on 127.0.0.1, or with unix_socket=True a socket in a private
    temp folder; metrics_listen: "" (off) unless given. Raises ConfigError (a config or data
    error, with the server's message) or ServeError (a dataset failed, or no start within
    timeout_s); the server is stopped before either reaches the caller."""
    workdir = Path(tempfile.mkdtemp(prefix="batchqueue-"))
    server: ServerProcess | None = None
    pipe: ParentPipe | None = None
    try:
        parsed, spec = _prepare(config, workdir, data_root, verbose)
        if listen is None:
            listen = f"unix:{workdir / SOCKET_FILE}" if unix_socket else "127.0.0.1:0"
        pipe = ParentPipe()
        args = ("--spec", str(spec), "--parent-pipe", str(pipe.read_fd))
        server = ServerProcess(
            workdir,
            data_root=parsed.data_root,
            listen=listen,
            args=(*args, "--metrics-listen", metrics_listen),
            command=CHILD_COMMAND,
            pass_fds=(pipe.read_fd,),
        )
        pipe.child_started()
        _wait_started(server, [d.name for d in parsed.datasets], timeout_s)
        yield server.address
    finally:
        try:
            if server is not None:
                server.stop()
        finally:
            if pipe is not None:
                pipe.close()
            shutil.rmtree(workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def serve_async(config: ConfigSource, **kwargs: Any) -> AsyncIterator[str]:
    """`async with serve_async(config) as address:` serve() with its start and stop in a
    thread, so the running event loop is never blocked; the same arguments."""
    manager = serve(config, **kwargs)
    address = await asyncio.to_thread(manager.__enter__)
    try:
        yield address
    except BaseException:
        if not await asyncio.to_thread(manager.__exit__, *sys.exc_info()):
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)


# ---- the child ----------------------------------------------------------------------------------


def _stop_before_serving(signum: int, frame: object) -> None:
    """SIGTERM before the server's own handler is in place (or after it is gone): exit,
    through the `finally` blocks, instead of dying at once."""
    raise SystemExit(128 + signum)


def child_main(argv: list[str]) -> int:
    """The server process: `queue-server` itself (its flags, logging, shutdown and exit codes),
    with its config loader handing over the spec's config instead of reading a TOML file.
    With --parent-pipe it stops (SIGTERM to itself, the graceful stop) once its parent is
    gone, and then removes the private folder its parent made, which nobody else will."""
    from queue_server import cli

    p = argparse.ArgumentParser(prog="python -m queue_server.serve_child", add_help=False)
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--parent-pipe", type=int)
    args, rest = p.parse_known_args(argv)
    spec = json.loads(args.spec.read_text(encoding="utf-8"))

    def spec_config(path: Path | None) -> ServerConfig:
        return parse_config(spec["tables"], config_dir=Path(spec["config_dir"]))

    cli.load_config = spec_config  # in this process only
    verbose = ["-v"] if spec.get("verbose") else []
    parent_gone = threading.Event()
    if args.parent_pipe is not None:
        signal.signal(signal.SIGTERM, _stop_before_serving)
        parent_gone = stop_with_parent(args.parent_pipe)
    try:
        return cli.main([*rest, "--config", str(args.spec), *verbose])
    finally:
        if parent_gone.is_set():
            shutil.rmtree(args.spec.parent, ignore_errors=True)


__all__ = ["ServeError", "serve", "serve_async"]
