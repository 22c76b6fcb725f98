"""`queue-server`: serve the datasets of a TOML config (the embedded default without one).

`queue-server reset DATASET [--config FILE] [--data-root DIR] [--delete]` moves a dataset's
directory aside (or deletes it), so that the next start rebuilds it from its inputs.

Exit codes: 0 after a stop asked for by SIGINT (Ctrl-C) or SIGTERM, once the staged shutdown
is done (workers stopped, temp files removed, journals closed); 2 for a config error or a
dataset that failed (its config, its inputs, its provider), after the same shutdown, unless
--keep-serving (server.keep_serving) keeps the other datasets up; 1 for an OS error such as
an address in use; 130 for a Ctrl-C before the server was up. A Ctrl-C reaches the workers
too (one process group); they ignore it, and the server stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_client.errors import ConfigError, InvalidRequest
from queue_client.format.layout import atomic_write
from queue_server.config.server import ServerConfig, load_config, parse_listen
from queue_server.host.parent_watch import check_parent_pipe, stop_with_parent
from queue_server.logs import configure_logging
from queue_server.reset import NothingToReset, reset_dataset

if TYPE_CHECKING:
    from queue_server.app import QueueServer
    from queue_server.dataset import DatasetRuntime


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="queue-server", description=__doc__)
    p.add_argument(
        "--config", type=Path, help="TOML config (default: the embedded stdlib_char dataset)"
    )
    p.add_argument(
        "--data-root", type=Path, help="where dataset dirs live (overrides server.data_root)"
    )
    p.add_argument(
        "--listen", help="HOST:PORT or unix:PATH (overrides server.listen; default 127.0.0.1:50051)"
    )
    p.add_argument(
        "--metrics-listen",
        help='HTTP /metrics and /healthz: HOST:PORT, unix:PATH, or "" for off (default 127.0.0.1:50052)',
    )
    p.add_argument(
        "--ranks",
        help='the global ranks this server serves: "all", a list or range such as 0,1 or '
        "0-3, or \"launcher\" for this node's share from torchrun's environment "
        "(overrides server.ranks)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="the world size those ranks belong to (overrides server.world_size)",
    )
    p.add_argument(
        "--control-plane",
        help="tcpstore://HOST:PORT: the job's torch.distributed TCPStore (torchrun's "
        "MASTER_ADDR:MASTER_PORT), where every server of the job shares its steering changes "
        "(overrides server.control_plane)",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        help="write {address, metrics_address, pid} here as JSON once bound",
    )
    p.add_argument(
        "--keep-serving",
        action="store_true",
        default=None,
        help="when a dataset fails, keep serving the others and report it NOT_SERVING with its "
        "reason in health and stats, instead of exiting with code 2 (sets server.keep_serving)",
    )
    p.add_argument(
        "--parent-pipe",
        type=int,
        metavar="FD",
        help="the read end of a pipe inherited from the process that started this one: when "
        "its write end closes (that process ended, however), stop as on SIGTERM. For a "
        "supervisor or a test harness whose children must not outlive it",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log one line per produced file")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> ServerConfig:
    config = load_config(args.config)
    overrides: dict[str, Any] = {"verbose": args.verbose}
    if args.data_root is not None:
        overrides["data_root"] = args.data_root.expanduser().resolve()
    if args.listen is not None:
        parse_listen(args.listen)
        overrides["listen"] = args.listen
    if args.metrics_listen is not None:
        overrides["metrics_listen"] = args.metrics_listen
    if args.ranks is not None:
        overrides["ranks"] = args.ranks
    if args.world_size is not None:
        overrides["world_size"] = args.world_size
    if args.control_plane is not None:
        overrides["control_plane"] = args.control_plane
    if args.keep_serving:
        overrides["keep_serving"] = True
    return replace(config, **overrides)


class DatasetFailed(Exception):
    """A dataset failed and the server stopped for it (exit code 2); names it and the error."""


def _failure(server: QueueServer, failed: list[DatasetRuntime]) -> Exception:
    """The error the CLI exits with: a ConfigError when every failure is a config error
    (its first line names the key, as a config error at load does), else DatasetFailed."""
    if all(rt.config_error for rt in failed):
        return ConfigError("; ".join(f"datasets.{rt.name}: {rt.last_error}" for rt in failed))
    message = "; ".join(
        f"dataset {rt.name!r} failed"
        + ("" if rt.name in server.served_once else " to start")
        + f": {rt.last_error}"
        for rt in failed
    )
    if len(server.datasets) > 1:
        message += (
            "; the server stopped with it (--keep-serving, or server.keep_serving = true, "
            "keeps the other datasets serving)"
        )
    return DatasetFailed(message)


async def _serve(config: ServerConfig, ready_file: Path | None) -> None:
    """Serve until SIGINT or SIGTERM, or until a dataset fails (unless config.keep_serving);
    raises ConfigError or DatasetFailed for the latter, after the same staged shutdown.

    The server (and with it gRPC, a quarter second of CPU) is imported only here, once the
    config is known to be good: a config error exits before it, and so does the workers'
    forkserver, which gives up its torch import when this process is gone."""
    from queue_server.app import QueueServer

    log = logging.getLogger("queue_server")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reason: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.info("%s: already stopping", sig.name)
            return
        reason.append(sig.name)
        stop.set()

    # Before anything starts: a signal while starting is a stop, never a traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        server = QueueServer(config)
        address = await server.start()
        if not config.served.all:
            log.info("serving %s only", config.served.describe())
        if ready_file is not None:
            ready = {
                "address": address,
                "metrics_address": server.metrics_address,
                "pid": os.getpid(),
            }
            atomic_write(ready_file, json.dumps(ready).encode())

        async def stop_on_failure() -> None:
            await server.failure.wait()
            reason.append(f"dataset {server.failed[0].name} failed")
            stop.set()

        watcher = None if config.keep_serving else loop.create_task(stop_on_failure())
        try:
            await stop.wait()
        finally:
            # Only a failure that stopped the server exits 2: one during the shutdown is its
            # own doing, and with keep_serving a failed dataset is reported, not fatal.
            failed = list(server.failed) if watcher is not None and watcher.done() else []
            if watcher is not None:
                watcher.cancel()
            log.info("shutting down (%s)", reason[0] if reason else "stopped")
            await server.stop()
            log.info("stopped (exit code %d)", 2 if failed else 0)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if failed:
        raise _failure(server, failed)


def run(coro: object) -> None:
    """Run on uvloop where it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    uvloop.run(coro)  # type: ignore[arg-type]


def _reset(argv: list[str]) -> int:
    """`queue-server reset`: refused while a server holds the data root (exit 2)."""
    p = argparse.ArgumentParser(
        prog="queue-server reset",
        description="Move a dataset's directory aside inside the data root, so that the next "
        "start rebuilds it from its inputs. Nothing is deleted without --delete.",
    )
    p.add_argument("dataset", help="the dataset's name, as in [datasets.NAME]")
    p.add_argument("--config", type=Path, help="TOML config whose server.data_root to use")
    p.add_argument("--data-root", type=Path, help="the data root (overrides server.data_root)")
    p.add_argument("--delete", action="store_true", help="delete the directory, not move it")
    args = p.parse_args(argv)
    try:
        root = load_config(args.config).data_root if args.data_root is None else args.data_root
        done = reset_dataset(Path(root).expanduser().resolve(), args.dataset, delete=args.delete)
    except ConfigError as exc:
        print(f"queue-server reset: {exc}", file=sys.stderr)
        return 2
    except (InvalidRequest, NothingToReset, OSError) as exc:
        print(f"queue-server reset: {exc}", file=sys.stderr)
        return 1
    if done.deleted:
        print(f"deleted {done.dataset_dir}; the next start rebuilds dataset {args.dataset!r}")
    else:
        print(
            f"moved {done.dataset_dir} to {done.moved_to}; the next start rebuilds dataset "
            f"{args.dataset!r}. Once you no longer need the old one: rm -r '{done.moved_to}'"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reset"]:
        return _reset(argv[1:])
    if argv[:1] == ["control-store"]:
        from queue_server.steering.store_host import main as store_main

        return store_main(argv[1:])
    args = _parse_args(argv)
    configure_logging(args.verbose)
    if args.parent_pipe is not None:
        try:
            check_parent_pipe(args.parent_pipe)
        except ValueError as exc:
            print(f"queue-server: {exc}", file=sys.stderr)
            return 2
        stop_with_parent(args.parent_pipe)
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"queue-server: config error: {exc}", file=sys.stderr)
        return 2
    try:
        run(_serve(config, args.ready_file))
    except ConfigError as exc:
        print(f"queue-server: config error: {exc}", file=sys.stderr)
        return 2
    except DatasetFailed as exc:
        print(f"queue-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"queue-server: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the event loop's own handling of SIGINT
        print("queue-server: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
