"""Rows 1d and 1e over many loops: how often a tight loop meets them, not what one loop did.

    python -m bench.tight_loops --text data.txt --loops 12

The full bench runs the tight loop once per run, and one loop says little about a tail on a
shared machine: on 2 cores the same code meets 1e's p99 in some loops and misses it in the
next. This runs row 1c's loop `--loops` times on one server (char_lm, B=12 T=1024, files of
100 batches, 2 workers, a full backlog before each loop), prints each loop, and ends with how
many loops met each goal. Each call over the p99 goal is counted by what took most of its
time: the thread's own CPU, a wait for a core, or the GIL or a lock (see steady.tight_loop).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from bench.data import prepare
from bench.servers import Server, ServerSpec, dataset_toml
from bench.steady import SWITCH_MAX_GOAL_MS, SWITCH_P99_GOAL_MS, tight_loop
from bench.walker import FileWalker

B, T, BATCHES_PER_FILE, FILES_PER_LOOP, WORKERS = 12, 1024, 100, 10, 2
SLOW_KINDS = ("own CPU", "a core", "the GIL or a lock")


def run_loops(
    text: Path,
    workdir: Path,
    loops: int,
    *,
    prefetch_files: int = 2,
    worker_priority: str = "normal",
    fetch_process: bool = False,
) -> list[dict[str, Any]]:
    """`loops` tight loops of FILES_PER_LOOP files each, a full backlog before every one."""
    from queue_client import QueueClient

    backlog = FILES_PER_LOOP + 1
    table = dataset_toml(
        "loop",
        text=text,
        batch_size=B,
        block_size=T,
        batches_per_file=BATCHES_PER_FILE,
        backlog=backlog,
        workers=WORKERS,
        worker_priority=worker_priority,
    )
    server = Server(ServerSpec("loops", (table,)), workdir)
    results = []
    try:
        server.wait_serving(120)
        with QueueClient(
            server.address,
            "loop",
            rank=0,
            world_size=1,
            prefetch_files=prefetch_files,
            fetch_process=fetch_process,
        ) as client:
            walker = FileWalker(client, "train", BATCHES_PER_FILE, server, "loop", backlog)
            walker.open_next()
            walker.finish_file()
            walker.settle()
            for _ in range(loops):
                results.append(tight_loop(client, "train", FILES_PER_LOOP * BATCHES_PER_FILE))
                walker.settle()
    finally:
        server.stop()
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """How many loops met 1d (worst switch) and 1e (p99), with medians and slow calls."""
    n = len(results)
    p99 = [r["p99_us"] / 1e3 for r in results]
    worst = [r["switch_max_us"] / 1e3 for r in results]
    slow = {k: sum(r["slow_calls"].get(k, 0) for r in results) / n for k in SLOW_KINDS}
    return {
        "loops": n,
        "1d_met": sum(w <= SWITCH_MAX_GOAL_MS for w in worst),
        "1e_met": sum(p <= SWITCH_P99_GOAL_MS for p in p99),
        "both_met": sum(
            w <= SWITCH_MAX_GOAL_MS and p <= SWITCH_P99_GOAL_MS
            for w, p in zip(worst, p99, strict=True)
        ),
        "p99_median_ms": median(p99),
        "switch_max_median_ms": median(worst),
        "slow_calls_per_loop": sum(r["slow_calls"].get("calls", 0) for r in results) / n,
        "slow_calls_by_kind_per_loop": slow,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tight_loops", description=__doc__)
    parser.add_argument("--text", type=Path, help="a UTF-8 text (default: generated)")
    parser.add_argument("--loops", type=int, default=12)
    parser.add_argument("--prefetch-files", type=int, default=2)
    parser.add_argument("--worker-priority", choices=("normal", "idle"), default="normal")
    parser.add_argument(
        "--fetch-process", action="store_true", help="QueueClient(fetch_process=True)"
    )
    parser.add_argument("--workdir", type=Path, help="default: a temp dir, removed after")
    parser.add_argument("--json", type=Path, help="also write each loop and the summary here")
    args = parser.parse_args(argv)
    if args.loops < 1:
        parser.error(f"--loops must be >= 1, got {args.loops}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="batchqueue-loops-"))
    try:
        tokens = prepare(args.text, workdir, quick=False)
        results = run_loops(
            tokens.text_path,
            workdir,
            args.loops,
            prefetch_files=args.prefetch_files,
            worker_priority=args.worker_priority,
            fetch_process=args.fetch_process,
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for i, r in enumerate(results):
        kinds = ", ".join(f"{k} {r['slow_calls'].get(k, 0)}" for k in SLOW_KINDS)
        print(
            f"loop {i:3d}  p99 {r['p99_us'] / 1e3:.3f} ms  worst switch "
            f"{r['switch_max_us'] / 1e3:.3f} ms  calls over {SWITCH_P99_GOAL_MS:g} ms: "
            f"{r['slow_calls'].get('calls', 0)} ({kinds})"
        )
    s = summary(results)
    print(
        f"1d (worst switch <= {SWITCH_MAX_GOAL_MS:g} ms) met in {s['1d_met']} of {s['loops']} "
        f"loops, median {s['switch_max_median_ms']:.3f} ms; 1e (p99 <= "
        f"{SWITCH_P99_GOAL_MS:g} ms) met in {s['1e_met']}, median {s['p99_median_ms']:.3f} ms; "
        f"both in {s['both_met']}"
    )
    if args.json:
        args.json.write_text(json.dumps({"loops": results, "summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
