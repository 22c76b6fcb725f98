"""Row 8's big-vocabulary cases: the composer alone, on GPT-2-sized ids.

Candidate files of Zipf-distributed ids (vocabulary 50,257, B x T tokens per batch) are
written to the work dir with their histograms, as a provider writes them.

- 8d, 8e: one composer in this process composes served files from a buffer of `capacity`
  batches at alpha 1.0 and 0.0. Timed in CPU seconds of this process (torch and numpy's
  OpenBLAS on one thread, as in a worker), so the figure is tokens per second per core
  whatever else runs on the machine; the first file (which also fills the buffer) is left out. The goal: twice the
  0.93 M tokens/s per core the composer made before its scoring was vectorised.
- 8f: the same files composed by two composer processes sharing the buffer (as
  `composer_workers = 2` runs them: every pick is the best of their proposals) against one
  composer process, in wall-clock time. Judged only with at least 3 cores (two composers
  and the process that passes their answers on).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.harness import Result, Settings, fmt, median

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

VOCAB = 50_257
ZIPF = 1.1
BEFORE_MTOK_S = 0.93  # M tokens/s per core of the composer before vectorised scoring
GOAL_PER_CORE = 2.0
GOAL_TWO = 1.7


def _candidates(directory: Path, count: int, batches: int, b: int, t: int) -> dict[int, Path]:
    import torch

    from queue_client.format.batchfile import write_batch_file
    from queue_providers.histograms import token_histograms

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF
    p /= p.sum()
    paths = {}
    for c in range(count):
        x = torch.from_numpy(rng.choice(VOCAB, size=(batches, b, t), p=p).astype(np.int64))
        meta = {
            "dataset": "bench",
            "split": "train",
            "batch_size": b,
            "schema": [{"name": "x", "dtype": "int64", "shape": [t]}],
        }
        published = write_batch_file(
            directory,
            seq=c,
            tensors={"x": x},
            metadata=meta,
            extras=token_histograms({"x": x}, "x"),
        )
        paths[c] = directory / str(published.name)
    return paths


def _corpus() -> np.ndarray:
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF
    return p / p.sum()


def _settings(per_file: int, capacity: int, alpha: float) -> Any:
    from queue_server.curriculum.composer import ComposerSettings
    from queue_server.curriculum.schedule import AlphaSchedule

    return ComposerSettings(VOCAB, per_file, per_file, capacity, 2.0, AlphaSchedule(alpha))


def _per_core_ms(per_file: int, capacity: int, plans: int, alpha: float, paths: dict) -> float:
    """CPU ms per composed batch of one composer in this process, the first file left out."""
    import torch

    from queue_server.curriculum.composer import Composer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        composer = Composer(_settings(per_file, capacity, alpha), _corpus())
        per_batch = []
        for seq in range(plans):
            composer.attach({c: paths[c] for c in composer.held() + composer.needed()})
            began = time.process_time()
            composer.compose(seq, 1, [])
            per_batch.append((time.process_time() - began) * 1e3 / per_file)
            composer.detach_unheld()
    finally:
        torch.set_num_threads(threads)
    return median(per_batch[1:] or per_batch)


def _serve(conn: Connection, per_file: int, capacity: int, shard: int, shards: int) -> None:
    """A composer process: the steps of host.py, over a pipe."""
    import torch

    from queue_server.curriculum.composer import Composer

    torch.set_num_threads(1)
    composer = Composer(_settings(per_file, capacity, 1.0), _corpus(), shard, shards)
    while True:
        op, arg = conn.recv()
        if op == "cpu":
            conn.send(time.process_time())
            continue
        if op == "stop":
            return
        if op == "compose":  # one composer: the whole file in one call
            seq, paths = arg
            composer.attach(paths)
            composer.compose(seq, 1, [])
            composer.detach_unheld()
            conn.send(composer.held() + composer.needed())
        elif op == "begin":
            seq, paths = arg
            composer.attach(paths)
            composer.begin(seq, 1, [])
            conn.send(composer.propose())
        elif op == "accept":
            composer.accept(arg)
            conn.send(composer.propose() if composer.picks_left() else composer.cull_scores())
        elif op == "finish":
            composer.finish(arg)
            composer.detach_unheld()
            conn.send(composer.held() + composer.needed())


class _Group:
    """`shards` composer processes sharing one buffer, driven as the lane drives them."""

    def __init__(self, per_file: int, capacity: int, shards: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch threads
        self.per_file, self.shards = per_file, shards
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for shard in range(shards):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, per_file, capacity, shard, shards))
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        cfg = _settings(per_file, capacity, 1.0)
        self.wanted = list(range(cfg.initial_files + cfg.files_per_plan))  # held + needed

    def everyone(self, op: str, arg: Any) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((op, arg))
        return [pipe.recv() for pipe in self.pipes]

    def compose(self, seq: int, paths: dict) -> tuple[float, float]:
        """Wall ms per batch of served file `seq`, and CPU ms per batch of the busiest
        composer."""
        from queue_server.curriculum.shards import best_of

        files = {c: paths[c] for c in self.wanted}
        cpu_before = self.everyone("cpu", None)
        began = time.perf_counter()
        if self.shards == 1:
            self.wanted = self.everyone("compose", (seq, files))[0]
        else:
            answers = self.everyone("begin", (seq, files))
            for _ in range(self.per_file):
                answers = self.everyone("accept", best_of(answers))
            self.wanted = self.everyone("finish", [s for a in answers for s in a])[0]
        wall = (time.perf_counter() - began) * 1e3 / self.per_file
        spent = [a - b for a, b in zip(self.everyone("cpu", None), cpu_before, strict=True)]
        return wall, max(spent) * 1e3 / self.per_file

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(("stop", None))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _one_and_two(per_file: int, capacity: int, plans: int, paths: dict) -> dict[int, list]:
    """Per composer count: [wall ms, busiest CPU ms] per batch, medians over the files after
    the first; the two groups compose each file in turn, so the machine's load is shared."""
    groups = {n: _Group(per_file, capacity, n) for n in (1, 2)}
    try:
        times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
        for seq in range(plans):
            for n in (1, 2) if seq % 2 else (2, 1):
                times[n].append(groups[n].compose(seq, paths))
        return {
            n: [median([t[k] for t in ts[1:] or ts]) for k in (0, 1)] for n, ts in times.items()
        }
    finally:
        for group in groups.values():
            group.close()


def run(settings: Settings) -> list[Result]:
    b, t = settings.pick((12, 1024), (4, 256))
    per_file = settings.pick(50, 8)
    capacity = settings.pick(1000, 64)
    plans = settings.pick(8, 2)
    cfg = _settings(per_file, capacity, 1.0)
    needed = cfg.initial_files + cfg.files_per_plan * (plans + 1)
    paths = _candidates(settings.workdir / "composer-scale", needed, per_file, b, t)
    results = []
    for alpha in (1.0, 0.0):
        pick_ms = _per_core_ms(per_file, capacity, plans, alpha, paths)
        mtok_s = b * t / pick_ms / 1e3
        judged = alpha == 1.0 and not settings.quick
        results.append(
            Result(
                "8",
                f"composer, vocab {VOCAB:,}, buffer {capacity}, B={b} T={t}, alpha {alpha:g}",
                mtok_s,
                "M tok/s/core",
                "the composer before vectorised scoring",
                BEFORE_MTOK_S,
                "M tok/s/core",
                mtok_s / BEFORE_MTOK_S,
                "x before",
                f">= {GOAL_PER_CORE:.2f}x" if alpha == 1.0 else "info",
                (mtok_s / BEFORE_MTOK_S >= GOAL_PER_CORE) if judged else None,
                f"{fmt(pick_ms)} CPU ms per batch ({fmt(1e3 / pick_ms)} batches per core-second)",
            )
        )
    figures = _one_and_two(per_file, capacity, plans, paths)
    (one, one_cpu), (two, two_cpu) = figures[1], figures[2]
    cores = os.cpu_count() or 1
    enough = cores >= 3
    load = os.getloadavg()[0]
    results.append(
        Result(
            "8",
            f"composer_workers = 2, vocab {VOCAB:,}, buffer {capacity}, alpha 1",
            two,
            "ms/batch",
            "composer_workers = 1",
            one,
            "ms/batch",
            one / two,
            "x faster",
            f">= {GOAL_TWO:.2f}x" if enough else "info",
            (one / two >= GOAL_TWO) if enough and not settings.quick else None,
            f"wall clock; os.cpu_count() = {cores}, load {load:.1f}"
            + ("" if enough else ": fewer than 3 cores (2 composers + the relay), not judged")
            + f"; CPU per batch: one composer {fmt(one_cpu)} ms, the busier of two "
            f"{fmt(two_cpu)} ms ({fmt(one_cpu / two_cpu)}x on free cores, relay waits aside)",
        )
    )
    return results
