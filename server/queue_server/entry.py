"""The `queue-server` command's entry point: what must be set before gRPC is imported, the
forkserver's start, then cli.main (which imports the server, and with it gRPC)."""

from __future__ import annotations

import os
import sys


def prepare_server_process(start_workers: bool = True, preload_torch: bool = True) -> None:
    """What a server process does before it imports gRPC: `queue-server`'s (main below) and
    serve()'s child's (serve_child.py). `preload_torch`: whether the workers' forkserver
    imports torch for them (production/worker_imports.py)."""
    # The server starts processes by fork+exec (the forkserver, the head of a "local" Ray
    # instance). gRPC's fork handlers only log noise for that ("skipping fork() handlers"), and
    # gRPC reads this once, when it is first imported.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if start_workers:
        # The workers' forkserver imports torch where they need it (a second or more of
        # CPU): started first, it runs beside the server's own imports and start, and the
        # first file is made that much sooner. It ends by itself when this process does,
        # whatever happens next.
        from queue_server.production.forkserver_start import start_forkserver

        start_forkserver(preload_torch)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[:1]
    start_workers = command not in (["reset"], ["control-store"]) and not {"-h", "--help"} & set(
        args
    )
    prepare_server_process(start_workers, start_workers and _config_needs_torch(args))
    from queue_server.cli import main as cli_main

    return cli_main(argv)


def _config_needs_torch(args: list[str]) -> bool:
    """Whether the workers of the config that `args` name (--config) need torch preloaded."""
    import argparse
    from pathlib import Path

    from queue_server.production.worker_imports import config_needs_torch

    # Only a peek: any fault in the arguments is the command's own to report, with its usage.
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config", type=Path)
    try:
        known, _ = parser.parse_known_args(args)
    except argparse.ArgumentError:
        return True
    return config_needs_torch(known.config)
