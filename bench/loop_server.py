"""A queue server on a chosen event loop, for row 4's uvloop-against-asyncio comparison.

The `queue-server` CLI always runs uvloop; this runs the same `create_server` under either
loop, with the CLI's flags (--config, --data-root, --listen, --ready-file, --parent-pipe),
and stops on SIGTERM or SIGINT.

    python -m bench.loop_server --loop asyncio --config c.toml --listen 127.0.0.1:0 --ready-file r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

from queue_server.app import create_server
from queue_server.config.server import ServerConfig, load_config
from queue_server.host.parent_watch import stop_with_parent


async def _serve(config: ServerConfig, ready_file: Path) -> None:
    server, address = await create_server(config)
    tmp = ready_file.with_name(ready_file.name + ".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(tmp, ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loop", choices=("uvloop", "asyncio"), required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--parent-pipe", type=int, help="stop once the starting process is gone")
    args = p.parse_args()
    if args.parent_pipe is not None:
        stop_with_parent(args.parent_pipe)
    config = replace(
        load_config(args.config), data_root=args.data_root.resolve(), listen=args.listen
    )
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(_serve(config, args.ready_file))
    else:
        asyncio.run(_serve(config, args.ready_file))


if __name__ == "__main__":
    main()
