"""Rows 1 and 2: get_batch on CPU in steady state, beside nanoGPT's get_batch and a torch
DataLoader (row 1) and beside memcpy of the same bytes (row 2), on the same token data.

Each repeat measures, in a rotating order: batchqueue zero-copy (the rest of one file, after
the prefetch of the next has finished and the provider idles) followed by memcpy of exactly
those batches (the served int64 bytes) into preallocated tensors; batchqueue with copy=True; nanoGPT; the DataLoader.
Figures are medians over repeats. The zero-copy and copy clients read separate datasets with
the same config, because ranks of one dataset must advance in lockstep.

Batch files store x and y as one uint16 window per row: get_batch(out=...) widens straight from
it (one copy_ per field, reading a quarter of the bytes memcpy reads), copy=True widens into
fresh memory, and "zero-copy" calls (no out=, no copy=True) widen just the batch's rows into
memory of their own: no file is decoded whole, in the prefetch thread or anywhere.

"Steady in a file" excludes the file boundary, whose cost is row 3's subject; "amortised"
reads many files back to back in a tight loop that sums every batch (as a trainer touches
it), from a full backlog: the zero-copy datasets run AMORTISED_WORKERS provider workers and
keep AMORTISED_FILES files ready, so the loop measures the client, file switches included,
not the provider (row 5 is the provider's rate). 1c's goal is 3x nanoGPT; the same loop gives
the worst wait at a file switch (goal: at most 2 ms) and the p99 wait of any call (0.1 ms).
The goal shape's loop runs twice more: with provider workers at worker_priority "idle", and
with no loader at all (bare_loop.py), the floor those waits read against.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench import baselines
from bench.bare_loop import BareWindows
from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median, percentile
from bench.servers import Server, ServerSpec, dataset_toml
from bench.walker import FileWalker

SHAPES = ((12, 1024), (64, 256))
BACKLOG = 2
DATALOADER_WORKERS = 2
NANOGPT_GOAL, DATALOADER_GOAL, COPY_GOAL = 50.0, 100.0, 1.3
AMORTISED_WORKERS, AMORTISED_GOAL = 2, 3.0
AMORTISED_FILES = 10
SWITCH_MAX_GOAL_MS, SWITCH_P99_GOAL_MS = 2.0, 0.1


def _shapes(settings: Settings) -> tuple[tuple[int, int], ...]:
    return settings.pick(SHAPES, SHAPES[:1])  # the smoke version runs the code once


def _dataset(b: int, t: int, copy: bool) -> str:
    return f"steady_b{b}_t{t}{'_copy' if copy else ''}"


# The goal shape's tight loop again, on a dataset whose workers run at worker_priority "idle".
IDLE = "steady_idle"


def batches_per_file(settings: Settings) -> int:
    return settings.pick(100, 8)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    nb = batches_per_file(settings)
    datasets = [
        dataset_toml(
            _dataset(b, t, copy),
            text=tokens.text_path,
            batch_size=b,
            block_size=t,
            batches_per_file=nb,
            backlog=BACKLOG if copy else settings.pick(AMORTISED_FILES, 2) + 1,
            workers=1 if copy else AMORTISED_WORKERS,
        )
        for b, t in _shapes(settings)
        for copy in (False, True)
    ]
    b, t = SHAPES[0]
    datasets.append(
        dataset_toml(
            IDLE,
            text=tokens.text_path,
            batch_size=b,
            block_size=t,
            batches_per_file=nb,
            backlog=settings.pick(AMORTISED_FILES, 2) + 1,
            workers=AMORTISED_WORKERS,
            worker_priority="idle",
        )
    )
    return [ServerSpec("steady", tuple(datasets))]


def _per_batch_us(ns: int, n: int) -> float:
    return ns / max(n, 1) / 1e3


def _memcpy_us(views: list, dx: torch.Tensor, dy: torch.Tensor) -> float:
    began = time.perf_counter_ns()
    for x, y in views:
        dx.copy_(x)
        dy.copy_(y)
    return _per_batch_us(time.perf_counter_ns() - began, len(views))


def _time_calls(fn: Callable[[], object], n: int) -> float:
    began = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return _per_batch_us(time.perf_counter_ns() - began, n)


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    server = found["steady"]
    loaders = {
        shape: baselines.dataloader_batches(
            tokens.train_bin, shape[0], shape[1], DATALOADER_WORKERS
        )
        for shape in _shapes(settings)
    }
    for it in loaders.values():  # start the workers and fill their queues before any timing
        for _ in range(2 * DATALOADER_WORKERS + 2):
            next(it)
    results: list[Result] = []
    # The goal shape's loop again: with "idle" workers, and with no loader at all.
    loops: dict[str, dict[str, Any]] = {}
    for (b, t), loader in loaders.items():
        results += _measure_shape(settings, tokens, server, b, t, loader, loops)
    helper = _helper_loop(settings, server)
    return (
        results
        + _idle_rows(loops.get("idle", {}))
        + _bare_rows(loops.get("bare", {}))
        + _helper_rows(helper)
    )


def _helper_loop(settings: Settings, server: Server) -> dict[str, Any]:
    """1d and 1e's loop again, on the goal shape's dataset, through a fetch helper process
    (QueueClient(fetch_process=True)): nothing of the loader in the trainer's process. A
    fresh client reads the stream from its start again (the server makes those seqs anew)."""
    from queue_client import QueueClient

    b, t = SHAPES[0]
    nb, files = batches_per_file(settings), settings.pick(AMORTISED_FILES, 2)
    name = _dataset(b, t, False)
    with QueueClient(server.address, name, rank=0, world_size=1, fetch_process=True) as client:
        walker = FileWalker(client, "train", nb, server, name, files + 1)
        walker.open_next()
        walker.finish_file()
        walker.settle()
        # One loop untimed first: the zero-copy client of 1c-1e had read many files before
        # its loop, so its read-ahead had grown to what a fast trainer gets; a fresh client
        # starts at prefetch_files.
        tight_loop(client, "train", files * nb)
        walker.settle()  # a full backlog, as for 1c-1e
        return tight_loop(client, "train", files * nb)


def _helper_rows(loop: dict[str, Any]) -> list[Result]:
    b, t = SHAPES[0]
    return _wait_rows(
        f"B={b} T={t}",
        ", fetch_process=True",
        loop,
        goals=True,
        switch_note=f"1d's loop through a fetch helper process; mean "
        f"{fmt(loop['switch_mean_us'])} µs over {loop['switches']} switches; "
        f"{fmt(loop['per_call_us'])} µs per call amortised",
    )


def _idle_loop(settings: Settings, server: Server) -> dict[str, Any]:
    """1d and 1e's loop on the same windows, its provider workers at worker_priority "idle"
    (SCHED_IDLE): they run on cores the trainer leaves free. Run while every other dataset
    of the server idles with a full backlog, and left with its own backlog full again."""
    from queue_client import QueueClient

    nb, files = batches_per_file(settings), settings.pick(AMORTISED_FILES, 2)
    with QueueClient(server.address, IDLE, rank=0, world_size=1) as client:
        walker = FileWalker(client, "train", nb, server, IDLE, files + 1)
        walker.open_next()
        walker.finish_file()
        walker.settle()  # a full backlog, as for 1c-1e
        loop = tight_loop(client, "train", files * nb)
        walker.settle()  # (the loop read whole files) its refill done before 1c-1e's loop
    return loop


def _idle_rows(loop: dict[str, Any]) -> list[Result]:
    if not loop:
        return []
    b, t = SHAPES[0]
    return _wait_rows(
        f"B={b} T={t}",
        ', workers at worker_priority = "idle"',
        loop,
        goals=True,
        switch_note=f"1d's loop; mean {fmt(loop['switch_mean_us'])} µs over {loop['switches']} "
        f"switches; {fmt(loop['per_call_us'])} µs per call amortised; the slowest call of all: "
        f"{fmt(loop['max_us'])} µs",
    )


def _bare_loop(settings: Settings, tokens: Tokens) -> dict[str, Any]:
    """1d and 1e's loop on rows of the same windows held in memory, with no loader."""
    b, t = SHAPES[0]
    files = settings.pick(AMORTISED_FILES, 2)
    bare = BareWindows(tokens.train_bin, b, t, batches_per_file(settings), files)
    return tight_loop(bare, "train", files * batches_per_file(settings))


def _bare_rows(loop: dict[str, Any]) -> list[Result]:
    if not loop:
        return []
    b, t = SHAPES[0]
    slow = loop["slow_calls"].get("calls")
    over = f"; {slow} calls over {SWITCH_P99_GOAL_MS * 1e3:g} µs" if slow is not None else ""
    return [
        Result(
            "1",
            f"get_batch B={b} T={t}, wait of any call, p99, the same loop with no loader "
            "(rows sliced and widened in memory)",
            loop["p99_us"] / 1e3,
            "ms",
            goal="info",
            note=f"the floor of 1e and 1l on this machine, run between them; "
            f"{fmt(loop['per_call_us'])} µs per call{over}",
        )
    ]


def _wait_rows(
    shape: str, where: str, loop: dict[str, Any], *, goals: bool, switch_note: str
) -> list[Result]:
    """A tight loop's worst wait at a file switch (1d's goal) and p99 of any call (1e's)."""
    switch_ms, p99_ms = loop["switch_max_us"] / 1e3, loop["p99_us"] / 1e3
    return [
        Result(
            "1",
            f"get_batch {shape}, wait at a file switch, max{where}",
            switch_ms,
            "ms",
            goal=f"<= {SWITCH_MAX_GOAL_MS:g} ms" if goals else "info",
            met=switch_ms <= SWITCH_MAX_GOAL_MS if goals else None,
            note=switch_note,
        ),
        Result(
            "1",
            f"get_batch {shape}, wait of any call, p99{where}",
            p99_ms,
            "ms",
            goal=f"<= {SWITCH_P99_GOAL_MS:g} ms" if goals else "info",
            met=p99_ms <= SWITCH_P99_GOAL_MS if goals else None,
            note=f"p99 of the {loop['switches']} file switches alone: "
            f"{fmt(loop['switch_p99_us'])} µs" + _core_bound_note(loop),
        ),
    ]


def _measure_shape(
    settings: Settings,
    tokens: Tokens,
    server: Server,
    b: int,
    t: int,
    loader: Iterator,
    loops: dict[str, dict[str, Any]],
) -> list[Result]:
    from queue_client import QueueClient

    nb = batches_per_file(settings)
    n_calls = settings.pick(100, 4)
    files = settings.pick(AMORTISED_FILES, 2)
    samples: dict[str, list[float]] = {
        k: [] for k in ("zero", "copy", "into", "memcpy_cold", "memcpy", "nanogpt", "dataloader")
    }
    dx, dy = torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)
    ox, oy = torch.empty(b, t, dtype=torch.int64), torch.empty(b, t, dtype=torch.int64)
    zero = QueueClient(server.address, _dataset(b, t, False), rank=0, world_size=1)
    copy = QueueClient(server.address, _dataset(b, t, True), rank=0, world_size=1, copy=True)
    try:
        backlog = files + 1
        w0 = FileWalker(zero, "train", nb, server, _dataset(b, t, False), backlog)
        w1 = FileWalker(copy, "train", nb, server, _dataset(b, t, True), BACKLOG)

        def zero_copy_then_memcpy() -> None:
            w0.open_next()
            w0.settle()
            # Each batch dropped after the call, as a trainer's step drops it: narrow ids are
            # widened per call, into memory the allocator reuses once the batch goes.
            ns, n = w0.time_rest_of_file()
            samples["zero"].append(_per_batch_us(ns, n))
            # memcpy of as many batches of served int64 bytes, each in memory of its own.
            views = [(torch.randint(0, 65, (b, t)), torch.randint(0, 65, (b, t))) for _ in range(n)]
            samples["memcpy_cold"].append(_memcpy_us(views, dx, dy))  # first touch of the map
            samples["memcpy"].append(_memcpy_us(views, dx, dy))

        def with_copy() -> None:
            w1.open_next()
            w1.settle()
            samples["copy"].append(_per_batch_us(*w1.time_rest_of_file()))

        def into_buffers() -> None:
            w1.open_next()
            w1.settle()
            samples["into"].append(_per_batch_us(*w1.time_rest_of_file(out=(ox, oy))))

        def nanogpt() -> None:
            samples["nanogpt"].append(
                _time_calls(lambda: baselines.nanogpt_get_batch(tokens.train_bin, b, t), n_calls)
            )

        def dataloader() -> None:
            for _ in range(2 * DATALOADER_WORKERS):  # what the workers prepared while idle
                next(loader)
            samples["dataloader"].append(_time_calls(lambda: next(loader), n_calls))

        units = [zero_copy_then_memcpy, with_copy, into_buffers, nanogpt, dataloader]
        for r in range(settings.repeats):
            for unit in units[r % len(units) :] + units[: r % len(units)]:
                unit()
        w0.finish_file()
        w0.settle()  # a full backlog: `files` files ready, and the next one prefetched
        if (b, t) == SHAPES[0]:
            loops["idle"] = _idle_loop(settings, server)
            loops["bare"] = _bare_loop(settings, tokens)
            w0.settle()
        loop = tight_loop(zero, "train", files * nb)
    finally:
        zero.close()
        copy.close()
    return _rows(b, t, {k: median(v) for k, v in samples.items()}, loop, files, nb)


def tight_loop(client: object, split: str, calls: int) -> dict[str, Any]:
    """`calls` get_batch calls back to back, each batch summed: the time inside get_batch
    per call, and the waits of the calls that switch files (max, p99) and of all (p99), in
    µs. The stream_view read that labels a call is outside its timed span."""
    get, view = client.get_batch, client.stream_view  # type: ignore[attr-defined]
    now, cpu = time.perf_counter_ns, time.thread_time_ns
    queued = _RunQueueClock()
    waits: list[int] = []
    # Calls over the p99 goal: (wait, own CPU time, run-queue time), in ns.
    slow: list[tuple[int, int, int]] = []
    switches: list[int] = []
    switch_cpu: list[int] = []
    began = now()
    for _ in range(calls):
        opens = view(split).opens_file
        q0 = queued()
        c0 = cpu()
        t0 = now()
        x, y = get(split)
        t1 = now()
        c1 = cpu()
        q1 = queued()
        if t1 - t0 > SWITCH_P99_GOAL_MS * 1e6 and q0 >= 0:
            slow.append((t1 - t0, c1 - c0, q1 - q0))
        x.sum()
        y.sum()
        waits.append(t1 - t0)
        if opens:
            switches.append(t1 - t0)
            switch_cpu.append(c1 - c0)
    wall = now() - began
    known = queued.works
    queued.close()
    return {
        "per_call_us": sum(waits) / calls / 1e3,
        "wall_us": wall / calls / 1e3,
        "waiting_pct": 100 * sum(waits) / wall,
        "switches": len(switches),
        "switch_max_us": max(switches) / 1e3,
        "switch_p99_us": percentile(switches, 99) / 1e3,
        "switch_mean_us": sum(switches) / len(switches) / 1e3,
        "p99_us": percentile(waits, 99) / 1e3,
        "max_us": max(waits) / 1e3,
        # The trainer thread's own CPU time in a switch call: the client's work there, apart
        # from waiting for the prefetch, the GIL or a core of a loaded machine.
        "switch_cpu_max_us": max(switch_cpu) / 1e3,
        # Calls over the p99 goal, by what took most of their time: the thread's own CPU, a
        # wait for a core (runnable, none free: the kernel's schedstat), or neither (blocked:
        # the GIL, a lock). Empty where the kernel does not say.
        "slow_calls": _slow_calls(slow) if known else {},
    }


def _slow_calls(slow: list[tuple[int, int, int]]) -> dict[str, int]:
    counts = {"calls": len(slow), "own CPU": 0, "a core": 0, "the GIL or a lock": 0}
    for wait, own, queued in slow:
        blocked = wait - own - queued
        most = max((own, "own CPU"), (queued, "a core"), (blocked, "the GIL or a lock"))
        counts[most[1]] += 1
    return counts


class _RunQueueClock:
    """This thread's time runnable without a core, in ns, from the kernel's schedstat (Linux;
    -1 elsewhere). Read around a call, outside its timed span: one pread each."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = -1

    @property
    def works(self) -> bool:
        return self._fd >= 0

    def __call__(self) -> int:
        if self._fd < 0:
            return -1
        return int(os.pread(self._fd, 128, 0).split()[1])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _core_bound_note(loop: dict[str, Any]) -> str:
    slow = loop["slow_calls"]
    if not slow:
        return ""
    parts = ", ".join(f"{n} {what}" for what, n in slow.items() if what != "calls" and n)
    return (
        f"; {slow['calls']} calls over {SWITCH_P99_GOAL_MS * 1e3:g} µs, most of their time "
        f"spent on: {parts or 'nothing'} (schedstat)"
    )


def _rows(
    b: int, t: int, m: dict[str, float], loop: dict[str, Any], files: int, nb: int
) -> list[Result]:
    shape = f"B={b} T={t}"
    amortised = loop["per_call_us"]
    goals = (b, t) == SHAPES[0]

    def tok_s(us: float) -> str:
        return f"{fmt(b * t / us)}M tok/s"  # tokens per µs = M tokens per s

    zero, copy, nano, dl = m["zero"], m["copy"], m["nanogpt"], m["dataloader"]
    return [
        Result(
            "1",
            f"get_batch {shape}, steady in a file (zero-copy)",
            zero,
            "µs/batch",
            "nanoGPT get_batch",
            nano,
            "µs/batch",
            nano / zero,
            "x faster",
            f">= {NANOGPT_GOAL:g}x",
            nano / zero >= NANOGPT_GOAL,
            f"{tok_s(zero)}; nanoGPT {tok_s(nano)}; copy=True is {nano / copy:.0f}x faster",
            extra={"tokens_per_s": b * t / zero * 1e6},
        ),
        Result(
            "1",
            f"get_batch {shape}, steady in a file (zero-copy)",
            zero,
            "µs/batch",
            "DataLoader, 2 workers",
            dl,
            "µs/batch",
            dl / zero,
            "x faster",
            f">= {DATALOADER_GOAL:g}x",
            dl / zero >= DATALOADER_GOAL,
            f"DataLoader {tok_s(dl)}; copy=True is {dl / copy:.0f}x faster",
        ),
        Result(
            "1",
            f"get_batch {shape}, amortised over {files} files of {nb}, "
            f"{AMORTISED_WORKERS} provider workers, full backlog",
            amortised,
            "µs/batch",
            "nanoGPT get_batch",
            nano,
            "µs/batch",
            nano / amortised,
            "x faster",
            f">= {AMORTISED_GOAL:g}x" if goals else "info",
            nano / amortised >= AMORTISED_GOAL if goals else None,
            f"tight loop summing each batch, {loop['switches']} file switches included; "
            f"{loop['waiting_pct']:.0f}% of its wall time in get_batch ({fmt(loop['wall_us'])} "
            "µs per step)",
            extra={"loop": loop},
        ),
        *_wait_rows(
            shape,
            " (same loop)",
            loop,
            goals=goals,
            switch_note=f"mean {fmt(loop['switch_mean_us'])} µs over {loop['switches']} "
            f"switches, the trainer thread's own CPU time in one at most "
            f"{fmt(loop['switch_cpu_max_us'])} µs; the slowest call of all: "
            f"{fmt(loop['max_us'])} µs",
        ),
        Result(
            "2",
            f"get_batch(out=buffers) {shape}, steady in a file",
            m["into"],
            "µs/batch",
            "memcpy, preallocated",
            m["memcpy"],
            "µs/batch",
            m["into"] / m["memcpy"],
            "x memcpy",
            f"<= {COPY_GOAL:g}x",
            m["into"] / m["memcpy"] <= COPY_GOAL,
            f"reads {b * (t + 1) * 2 / 1e3:.0f} kB of uint16 windows, writes {2 * b * t * 8 / 1e3:.0f} kB "
            f"of int64 (memcpy: {2 * b * t * 8 / 1e3:.0f} kB each way); memcpy on first touch of the "
            f"views: {fmt(m['memcpy_cold'])} µs ({m['into'] / m['memcpy_cold']:.2f}x)",
        ),
        Result(
            "2",
            f"get_batch(copy=True) {shape}, steady in a file",
            copy,
            "µs/batch",
            "memcpy, preallocated",
            m["memcpy"],
            "µs/batch",
            copy / m["memcpy"],
            "x memcpy",
            "info",
            None,
            "fresh memory per batch (safe to keep): page faults cost more than the copy",
        ),
    ]
