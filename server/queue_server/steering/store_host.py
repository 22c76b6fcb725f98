"""`queue-server control-store --listen HOST:PORT`: host the job's control plane store (a
torch.distributed TCPStore master) where no launcher runs one the servers can reach, or where
it must outlive the training job's restarts. Every server then names it in
`server.control_plane = "tcpstore://HOST:PORT"`. It keeps its keys in memory: the servers'
journals hold every change too, and republish them to a store started afresh."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from queue_client.format.layout import atomic_write
from queue_server.steering.store import SCHEME, host_store


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="queue-server control-store", description=__doc__)
    p.add_argument(
        "--listen",
        default="127.0.0.1:29600",
        help="HOST:PORT to listen on (port 0: any free one; default 127.0.0.1:29600)",
    )
    p.add_argument("--ready-file", type=Path, help="write {address, pid} here as JSON once bound")
    args = p.parse_args(argv)
    host, sep, port_text = args.listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        print(
            f"queue-server control-store: --listen {args.listen!r} is invalid: expected "
            "HOST:PORT (port 0 for any free one)",
            file=sys.stderr,
        )
        return 2
    host, port = host.strip("[]"), int(port_text)
    try:
        store = host_store(host, port)
    except Exception as exc:  # the port taken, an address not of this host
        print(
            f"queue-server control-store: cannot listen on {args.listen} (--listen): {exc}",
            file=sys.stderr,
        )
        return 1
    address = f"{host}:{store.port}"
    if args.ready_file is not None:
        atomic_write(args.ready_file, json.dumps({"address": address, "pid": os.getpid()}).encode())
    print(f"batchqueue control store listening on {SCHEME}{address}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0
