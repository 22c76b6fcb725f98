"""The `queue-server` command's entry point: what must be set before gRPC is imported, then
cli.main (which imports the server, and with it gRPC)."""

from __future__ import annotations

import os


def main(argv: list[str] | None = None) -> int:
    # The server starts processes by fork+exec (the forkserver, the head of a "local" Ray
    # instance). gRPC's fork handlers only log noise for that ("skipping fork() handlers"), and
    # gRPC reads this once, when it is first imported.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from queue_server.cli import main as cli_main

    return cli_main(argv)
