"""Row 11: production on Ray actors against local worker processes, and 2 actors against 1.

The same split's files, made by the real backends a server runs: `ProcessPoolBackend` (one
forkserver worker process, which publishes the file itself) and `RayBackend` (one or two
actors on a Ray instance this process starts; an actor returns the encoded file and this
process publishes it, so the bytes cross Ray's object store once). Each case makes the same
seqs of char_lm on the suite's text, 1 thread per producer as a server runs them; the cases
take turns in every repeat and the figure is the median.

- per actor: 1 actor against 1 local worker process, files of seqs 0..n-1 (goal >= 0.8x);
- scaling: 2 actors making seqs 0..2n-1 (slot = seq % 2, both busy at once) against 1 actor
  making seqs 0..n-1 (goal >= 1.6x where the machine has the cores: the two actors and this
  process, which publishes, need three; with fewer the goal is not judged).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median
from bench.servers import Server, ServerSpec

BATCH, BLOCK = 12, 256
SEED = 1337


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # the backends themselves, in this process: no server


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    if importlib.util.find_spec("ray") is None:
        return [
            Result(
                "11",
                "Ray backend production",
                None,
                "",
                note="Ray is not installed: pip install 'batchqueue[ray]'",
                skipped=True,
            )
        ]
    import ray

    # A local Ray instance for the row, started in this (the main) thread: Ray's processes
    # end with the thread that started them. No token file left behind in the home directory.
    # Three logical CPUs: the 1-actor and the 2-actor backends stay up side by side, and only
    # one of them works at a time.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=3, include_dashboard=False, namespace="batchqueue")
    try:
        return asyncio.run(_run(settings, tokens))
    finally:
        ray.shutdown()


async def _run(settings: Settings, tokens: Tokens) -> list[Result]:
    root = settings.workdir / "ray_production"
    bpf, files = settings.pick(50, 2), settings.pick(6, 2)
    init = _init(root, tokens.text_path, bpf)
    meta_json = await asyncio.to_thread(_settled_meta, init)
    tokens_per_file = bpf * BATCH * BLOCK
    backends = {
        "local": _local(init, meta_json, root),
        "ray1": _ray(init, meta_json, root, 1),
        "ray2": _ray(init, meta_json, root, 2),
    }
    rates: dict[str, list[float]] = {name: [] for name in backends}
    try:
        for backend in backends.values():
            await asyncio.gather(*(backend.start_slot(s, None) for s in range(backend.slots)))
            await _make(backend, range(backend.slots), root)  # warm: caches, pages, imports
        for r in range(settings.repeats):
            names = list(backends)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                backend = backends[name]
                n = files * backend.slots
                seconds = await _make(backend, range(n), root)
                rates[name].append(n * tokens_per_file / seconds)
    finally:
        for backend in backends.values():
            await backend.close()
        shutil.rmtree(root, ignore_errors=True)
    local, one, two = (median(rates[k]) for k in ("local", "ray1", "ray2"))
    cores = os.cpu_count() or 1
    enough = cores >= 3
    what = f"char_lm, B={BATCH} T={BLOCK}, {bpf} batches per file"
    return [
        Result(
            "11",
            f"Ray backend, 1 actor, {what}",
            one / 1e6,
            "M tokens/s",
            "1 local worker process",
            local / 1e6,
            "M tokens/s",
            one / local,
            "x local",
            ">= 0.8x",
            one / local >= 0.8,
            f"{fmt(one / tokens_per_file)} vs {fmt(local / tokens_per_file)} files/s",
            extra={"rates": rates["ray1"], "local": rates["local"]},
        ),
        Result(
            "11",
            f"Ray backend, 2 actors vs 1, {what}",
            two / 1e6,
            "M tokens/s",
            "1 actor",
            one / 1e6,
            "M tokens/s",
            two / one,
            "x 1 actor",
            ">= 1.6x with >= 3 cores",
            (two / one >= 1.6) if enough else None,
            f"os.cpu_count() = {cores}"
            + ("" if enough else ": fewer than 3 cores (2 actors + the publisher), not judged"),
            extra={"rates": rates["ray2"], "cpu_count": cores},
        ),
    ]


async def _make(backend: Any, seqs: range, root: Path) -> float:
    """Seconds for `backend` to make and publish `seqs` (slot = seq % slots, slots at once);
    the files are removed after, so every repeat writes into an empty directory."""
    from queue_server.production.backend import ProduceJob

    async def slot_jobs(slot: int) -> None:
        for seq in seqs:
            if seq % backend.slots == slot:
                await backend.produce(slot, ProduceJob("train", seq, {}))

    began = time.perf_counter()
    await asyncio.gather(*(slot_jobs(s) for s in range(backend.slots)))
    seconds = time.perf_counter() - began
    out = _queue_dir(root)
    await asyncio.to_thread(shutil.rmtree, out, True)
    out.mkdir(parents=True)
    return seconds


def _queue_dir(root: Path) -> Path:
    """Where every backend here publishes: the split's queue directory, as in a server."""
    from queue_client.format.layout import DatasetLayout

    return DatasetLayout(root / "data", "bench").queue_dir("train")


def _init(root: Path, text: Path, bpf: int) -> dict[str, Any]:
    """The init request a server sends its workers, for dataset "bench" of char_lm."""
    return {
        "data_root": str(root / "data"),
        "dataset": "bench",
        "provider": "char_lm",
        "args": {"input": str(text), "block_size": BLOCK},
        "batch_size": BATCH,
        "batches_per_file": bpf,
        "seed": SEED,
        "worker_index": 0,
        "num_workers": 1,
        "verbose": False,
        "extra_meta": {"provider": "char_lm", "config_fingerprint": "bench"},
        "histogram_field": "",
    }


def _settled_meta(init: dict[str, Any]) -> str:
    from queue_client.format.meta import meta_to_json
    from queue_server.production.provider_init import build_provider

    return meta_to_json(build_provider(init).complete_meta())


def _local(init: dict[str, Any], meta_json: str, root: Path) -> Any:
    from queue_server.production.process_pool import ProcessPoolBackend
    from queue_server.production.worker_process import WorkerProcess

    _queue_dir(root).mkdir(parents=True, exist_ok=True)
    return ProcessPoolBackend(
        "train",
        1,
        lambda index: WorkerProcess(f"bench worker {index}", dict(init), root),
        meta_json,
        _queue_dir(root),
    )


def _ray(init: dict[str, Any], meta_json: str, root: Path, slots: int) -> Any:
    from queue_server.production.ray.ray_backend import RayBackend

    return RayBackend(
        split="train",
        directory=_queue_dir(root),
        init=init,
        meta_json=meta_json,
        cwd=root,
        slots=slots,
        ray_address="local",
    )
