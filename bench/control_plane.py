"""The control plane's cost: per steering change and per file, and the store's growth per day.

    python -m bench.control_plane [--files 24] [--changes 20] [--join-records 100000]
                                  [--snapshot-every 4096] [--json out.json]

Two node-local servers (ranks 0-1 and 2-3 of 4) share a control store (`queue-server
control-store`, a torch.distributed TCPStore) and serve a three-source mixture of nanogpt_bin
corpora generated here; four ranks read `--files` files each in lockstep while rank 0 calls
set_mixture `--changes` times. Beside them, the same on one server without a plane. It prints
what the store holds (records: claims and changes; bytes), the records and bytes per file
made, and the latency of set_mixture with and without the plane (median and max over the
calls), then extrapolates the store's growth per day for a run of 1,000 GPUs (125 servers of
8 ranks) from the measured bytes per claim: a claim per server per round of files.

Then what a server that joins late pays: `--join-records` records (claims, a change every
100) appended to one log in the same store, and a fresh reader's store reads and seconds to
catch up, starting at the latest snapshot (every `--snapshot-every` records) against reading
the whole log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from queue_server.testing import SERVER_COMMAND, ServerProcess, wait_until

NAMES, B, NB, BLOCK = ("web", "code", "math"), 4, 5, 64


def config(tmp: Path) -> str:
    text = f"[datasets.mix]\nbatch_size = {B}\nbatches_per_file = {NB}\n"
    for i, name in enumerate(NAMES):
        d = tmp / name
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        for split in ("train", "val"):
            rng.integers(0, 1000, 200_000).astype(np.uint16).tofile(d / f"{split}.bin")
        text += textwrap.dedent(
            f"""
            [datasets.mix.sources.{name}]
            provider = "nanogpt_bin"
            weight = 1
            [datasets.mix.sources.{name}.args]
            data_dir = "{d.as_posix()}"
            block_size = {BLOCK}
            vocab_size = 1000
            """
        )
    return text


def run(servers: list[ServerProcess], files: int, changes: int) -> list[float]:
    """Four ranks read in lockstep; rank 0 reweights every few steps. Latencies of the calls."""
    from queue_client import QueueClient

    clients = [
        QueueClient(servers[r * len(servers) // 4].address, "mix", rank=r, world_size=4)
        for r in range(4)
    ]
    steps, every = files * NB, max(1, files * NB // max(1, changes))
    latencies = []
    try:
        for step in range(steps):
            for r, c in enumerate(clients):
                c.get_batch("train")
                if r == 0 and step % every == 0 and len(latencies) < changes:
                    w = (step % 7) + 1
                    began = time.perf_counter()
                    c.set_mixture({"web": w, "code": 1, "math": 1})
                    latencies.append(time.perf_counter() - began)
    finally:
        for c in clients:
            c.close()
    return latencies


def store_contents(address: str) -> dict[str, int]:
    """Records of each kind and their bytes, read back from the store."""
    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    out = {"claims": 0, "changes": 0, "claim_bytes": 0, "change_bytes": 0}
    for key in store.list_keys():
        if not key.startswith("batchqueue/") or "/snapshot-" in key:
            continue
        value = bytes(store.get(key))
        kind = "claim" if json.loads(value).get("kind") == "claim" else "change"
        out[f"{kind}s"] += 1
        out[f"{kind}_bytes"] += len(value) + len(key)
    return out


def join_cost(address: str, records: int, every: int) -> dict[str, Any]:
    """A fresh reader's catch-up on a log of `records` records: from the latest snapshot, and
    reading every record (the interval set past the log's length)."""
    from queue_server.steering.log import CLAIM, MIXTURE, ControlLog
    from queue_server.steering.store import TorchStore

    host, port = address.rsplit(":", 1)
    prefix = "batchqueue/bench-join/d/f/train/"
    writer = ControlLog(TorchStore(host, int(port), timeout_s=60), prefix, every)
    for i in range(records):
        record: dict[str, Any] = {"kind": CLAIM, "horizon": 8 * i, "by": "bench"}
        if i % 100 == 99:
            record = {"kind": MIXTURE, "value": {"web": i % 7 + 1}, "at": 8 * i, "rank": 0}
        writer.append(record)
    out: dict[str, Any] = {"join_records": records, "snapshot_every": every}
    for name, interval in (("snapshot", every), ("whole", 1 << 30)):
        reader = ControlLog(TorchStore(host, int(port), timeout_s=60), prefix, interval)
        began = time.perf_counter()
        entries = reader.read_new()
        out[f"join_s_{name}"] = time.perf_counter() - began
        out[f"join_reads_{name}"] = reader.gets
        out[f"join_changes_{name}"] = sum(1 for e in entries if e.kind != CLAIM)
    return out


def measure(
    workdir: Path, files: int, changes: int, join_records: int, every: int
) -> dict[str, Any]:
    text = config(workdir / "corpora")
    ready = workdir / "store.json"
    store = subprocess.Popen(
        [*SERVER_COMMAND, "control-store", "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
        stderr=subprocess.DEVNULL,
    )
    servers: list[ServerProcess] = []
    try:
        wait_until(ready.exists, 60, "the control store")
        address = json.loads(ready.read_text())["address"]
        plane = ("--world-size", "4", "--control-plane", f"tcpstore://{address}")
        for i, ranks in enumerate(("0,1", "2,3")):
            servers.append(
                ServerProcess(
                    workdir / f"s{i}",
                    data_root=workdir / f"root{i}",
                    config_text=text,
                    args=("--ranks", ranks, *plane),
                )
            )
        for s in servers:
            s.wait_serving(120)
        with_plane = run(servers, files, changes)
        produced = sum(int(s.split_stats("mix")["produced_files"]) for s in servers)
        contents = store_contents(address)
        joining = join_cost(address, join_records, every)
        for s in servers:
            s.kill()
        alone = ServerProcess(workdir / "alone", data_root=workdir / "root-alone", config_text=text)
        servers.append(alone)
        alone.wait_serving(120)
        without = run([alone], files, changes)
    finally:
        for s in servers:
            try:
                s.kill()
            except Exception:
                pass
        store.kill()
        store.wait(30)
    per_claim = contents["claim_bytes"] / max(1, contents["claims"])
    rounds_per_day = 86_400 / 50  # a file of 100 steps at 0.5 s a step, per rank
    return {
        "files_made": produced,
        **contents,
        "records_per_file": (contents["claims"] + contents["changes"]) / max(1, produced),
        "bytes_per_file": (contents["claim_bytes"] + contents["change_bytes"]) / max(1, produced),
        "bytes_per_claim": per_claim,
        "bytes_per_change": contents["change_bytes"] / max(1, contents["changes"]),
        "set_mixture_ms_plane": [1000 * median(with_plane), 1000 * max(with_plane)],
        "set_mixture_ms_alone": [1000 * median(without), 1000 * max(without)],
        # 125 servers x one claim per round of files x rounds a day
        "store_mb_per_day_1000_gpus": 125 * rounds_per_day * per_claim / 1e6,
        **joining,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__)
    p.add_argument("--files", type=int, default=24, help="files each rank reads")
    p.add_argument("--changes", type=int, default=20, help="set_mixture calls from rank 0")
    p.add_argument("--join-records", type=int, default=100_000, help="a late joiner's log")
    p.add_argument("--snapshot-every", type=int, default=4096, help="records between snapshots")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bq-control-"))
    try:
        figures = measure(workdir, args.files, args.changes, args.join_records, args.snapshot_every)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key:30} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
