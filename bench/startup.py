"""Row 15: what the loader costs before and beside training, against Grain doing the same.

batchqueue: a char_lm dataset (random windows B=12, T=1024, int64 x/y) with 2 train workers,
on a root whose meta is built (a first server built it and stopped). Timed from the launch
of `queue-server` to its ready file (bound), to health SERVING, and to the first batch in a
trainer that was already running; then every batch read is summed, and the PSS of the
server and all its children (forkserver, workers) is read from /proc/PID/smaps_rollup once
the backlog is full. Each launch finds the files the last one left on disk, and its trainer
resumes from the last one's state_dict, as a restart does: those files are served before any
worker has started (char_lm's inputs are fixed). A launch on a root that holds the meta alone
times a first batch that a worker must make. A val split nobody reads starts no worker. The
same launch through `serve()` in this process is timed to its return (SERVING) and to the
first batch.

Grain (extra `peers`; the row is skipped without it): bench/grain_peer.py in its own
process, the same windows from train.bin with 2 worker processes, timed from after the
trainer's imports to its first batch; PSS of its worker processes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.data import Tokens
from bench.harness import Result, Settings, median
from bench.servers import ServerSpec, child_env, dataset_toml, server_toml
from queue_server.testing import ServerProcess, wait_until

B, T = 12, 1024
WORKERS = 2
PSS_GOAL_MIB = 300.0
SERVING_GOAL_S, FIRST_BATCH_GOAL_S = 1.0, 1.5


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # launched here: the launch is what is timed


def pss_mib(pids: list[int]) -> float:
    from bench.grain_peer import pss_mib as pss

    return pss(pids)


def _config(settings: Settings, tokens: Tokens) -> str:
    nb = settings.pick(100, 8)
    table = dataset_toml(
        "start",
        text=tokens.text_path,
        batch_size=B,
        block_size=T,
        batches_per_file=nb,
        workers=WORKERS,
    )
    return server_toml([table])


def _meta_only_root(settings: Settings, n: int) -> Path:
    """A root with the built root's meta and input records and nothing else: no journal and
    no file on disk, so the first batch waits for a worker to make it."""
    from queue_client.format.layout import DatasetLayout

    built = DatasetLayout(settings.workdir / "startup-root", "start")
    root = settings.workdir / f"startup-meta-only-{n}"
    fresh = DatasetLayout(root, "start")
    fresh.meta_file.parent.mkdir(parents=True)
    for name in ("meta_file", "inputs_file"):
        shutil.copyfile(getattr(built, name), getattr(fresh, name))
    return root


def _launch(
    settings: Settings,
    tokens: Tokens,
    n: int,
    batches: int,
    root: Path | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, float]:
    from bench.grain_peer import children
    from queue_client import QueueClient

    began = time.monotonic()
    server = ServerProcess(
        settings.workdir / f"startup-{n}" if root is None else root.with_suffix(".server"),
        data_root=settings.workdir / "startup-root" if root is None else root,
        config_text=_config(settings, tokens),
        env=child_env(),
        metrics_listen=None,
    )
    try:
        server.wait_bound(120)
        bound = time.monotonic() - began
        server.wait_serving(120)
        serving = time.monotonic() - began
        with QueueClient(server.address, "start", rank=0, world_size=1) as client:
            if resume is not None and resume.get("state") is not None:
                client.load_state_dict(resume["state"])
            x, y = client.get_batch("train")
            first = time.monotonic() - began
            total = int(x.sum()) + int(y.sum())
            for _ in range(batches - 1):
                x, y = client.get_batch("train")
                total += int(x.sum()) + int(y.sum())
            # The backlog is full: files ready, and those the client leased ahead to read.
            wait_until(
                lambda: (s := server.split_stats("start"))["ready_files"] + s["leased_files"] >= 2,
                120,
                "2 files of start/train ready or leased ahead",
            )
            wait_until(
                lambda: len(server.split_stats("start")["worker_pids"]) == WORKERS,
                120,
                "both train workers",
            )
            pids = [server.pid, *children(server.pid)]
            pss = pss_mib(pids)
            if resume is not None:
                resume["state"] = client.state_dict()
        return {
            "bound": bound,
            "serving": serving,
            "first": first,
            "pss": pss,
            "procs": len(pids),
            "sum": total,
        }
    finally:
        server.stop()


def _launch_serve(settings: Settings, tokens: Tokens, resume: dict[str, Any]) -> dict[str, float]:
    """serve()'s launch on the same built root, with the files the last launch left: its
    return (it returns at SERVING) and the first batch, both from the call."""
    from queue_client import QueueClient
    from queue_server import serve

    config = _config(settings, tokens)
    began = time.monotonic()
    with serve(config, data_root=settings.workdir / "startup-root") as address:
        serving = time.monotonic() - began
        with QueueClient(address, "start", rank=0, world_size=1) as client:
            client.load_state_dict(resume["state"])
            x, y = client.get_batch("train")
            first = time.monotonic() - began
            total = int(x.sum()) + int(y.sum())
            resume["state"] = client.state_dict()
    return {"serving": serving, "first": first, "sum": total}


def _grain(tokens: Tokens, batches: int) -> dict[str, float] | None:
    if importlib.util.find_spec("grain") is None:
        return None
    cmd = [sys.executable, "-m", "bench.grain_peer", "--train-bin", str(tokens.train_bin)]
    cmd += ["--batch-size", str(B), "--block-size", str(T), "--batches", str(batches)]
    cmd += ["--workers", str(WORKERS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
    if done.returncode != 0:
        raise RuntimeError(f"bench.grain_peer exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(settings: Settings, tokens: Tokens, found: dict) -> list[Result]:
    batches = settings.pick(200, 10)
    repeats = settings.pick(3, 1)
    # The trainer of each launch on the built root resumes from the last one's state_dict,
    # as a restarted trainer does from its checkpoint (one started without it reads its
    # stream from seq 0 again, and those files are made again).
    resume: dict[str, Any] = {}
    _launch(settings, tokens, 0, 1, resume=resume)  # builds meta: the launches find it built
    ours, peer, served, unmade = [], [], [], []
    for i in range(repeats):  # interleaved, so that all see the same load
        ours.append(_launch(settings, tokens, i + 1, batches, resume=resume))
        served.append(_launch_serve(settings, tokens, resume))
        unmade.append(_launch(settings, tokens, i + 1, 1, _meta_only_root(settings, i + 1)))
        got = _grain(tokens, batches)
        if got is not None:
            peer.append(got)
    serving = median([r["serving"] for r in ours])
    first = median([r["first"] for r in ours])
    pss = median([r["pss"] for r in ours])
    procs = int(ours[0]["procs"])
    results = [
        Result(
            "15",
            "launch to SERVING, meta built",
            serving,
            "s",
            goal=f"<= {SERVING_GOAL_S:g} s",
            met=serving <= SERVING_GOAL_S,
            note=f"bound at {median([r['bound'] for r in ours]):.2f} s (interpreter and imports)",
        ),
        Result(
            "15",
            f"loader PSS, char_lm, {WORKERS} workers",
            pss,
            "MiB",
            goal=f"<= {PSS_GOAL_MIB:g} MiB",
            met=pss <= PSS_GOAL_MIB,
            note=f"server and its {procs - 1} children (forkserver, workers, resource tracker); "
            "val never read: no worker",
        ),
    ]
    s_serving = median([r["serving"] for r in served])
    s_first = median([r["first"] for r in served])
    results.append(
        Result(
            "15",
            "serve() to SERVING, meta built",
            s_serving,
            "s",
            goal=f"<= {SERVING_GOAL_S:g} s",
            met=s_serving <= SERVING_GOAL_S,
            note="from the call to its return; the server is a child process, as queue-server",
        )
    )
    results.append(
        Result(
            "15",
            "serve() to first batch",
            s_first,
            "s",
            goal=f"<= {FIRST_BATCH_GOAL_S:g} s",
            met=s_first <= FIRST_BATCH_GOAL_S,
            note="from the call, in a client of the calling process",
        )
    )
    u_first = median([r["first"] for r in unmade])
    results.append(
        Result(
            "15",
            "launch to first batch, no file on disk yet",
            u_first,
            "s",
            goal=f"<= {FIRST_BATCH_GOAL_S:g} s",
            met=u_first <= FIRST_BATCH_GOAL_S,
            note="meta alone: a worker makes the first file (char_lm's workers import no torch)",
        )
    )
    first_result = Result(
        "15",
        "launch to first batch",
        first,
        "s",
        goal=f"<= {FIRST_BATCH_GOAL_S:g} s",
        met=first <= FIRST_BATCH_GOAL_S,
        note="a restart that resumes its trainer's state: files on disk served before any worker",
    )
    if not peer:
        results.append(first_result)
        results.append(
            Result(
                "15",
                "Grain, 2 workers, same windows",
                None,
                "",
                skipped=True,
                note="grain is not installed (pip install -e '.[peers]')",
            )
        )
        return results
    g_first = median([r["first_batch_s"] for r in peer])
    g_pss = median([r["pss_mib"] for r in peer])
    first_result.ref_name, first_result.ref_value, first_result.ref_unit = "Grain", g_first, "s"
    first_result.ratio, first_result.ratio_label = first / g_first, "x Grain"
    results[1].ref_name, results[1].ref_value, results[1].ref_unit = "Grain workers", g_pss, "MiB"
    results[1].ratio, results[1].ratio_label = pss / g_pss, "x Grain"
    results.append(first_result)
    return results
