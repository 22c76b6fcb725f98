"""Row 5: what a trainer feels. Each rank is its own process running

    X, Y = client.get_batch("train"); spin for d ms

and reports the fraction of its wall time spent inside get_batch once warm (after its first
file). The ranks start together on a barrier. Two kinds of spin:

- GIL released: a C loop that keeps the core busy with the GIL free, as a trainer blocked on
  its GPU does (the CUDA driver spins inside a call that released the GIL). The goal's case.
- GIL held: a Python loop, as a step bound by Python code; the client's background threads
  (prefetch, release) then wait for the GIL, and the trainer waits for them in turn.

Runs with the same rank count share one dataset and resume each other's stream through
state_dict / load_state_dict, so no run starts on a cold queue and the server makes only the
files the runs read.

Where the provider stops keeping up: its capacity is measured first (one rank reading files
back to back, nothing else running); each run's demand is ranks * 1000 / d batches per second,
and a last sweep at d = 1 ms asks for more than the provider makes. On a machine with fewer
cores than ranks + 1 the spinning ranks also take CPU from the provider's worker process.
"""

from __future__ import annotations

import queue as queue_mod
import time
from dataclasses import dataclass
from typing import Any

from bench import procs
from bench.data import Tokens
from bench.harness import Result, Settings, fmt, spin_until
from bench.servers import Server, ServerSpec, dataset_toml
from bench.walker import FileWalker
from queue_server.testing import wait_until

B, T = 12, 1024
BACKLOG = 2
GOAL_PCT = 1.0


@dataclass(frozen=True)
class Run:
    step_ms: float
    ranks: int
    hold_gil: bool

    @property
    def demand(self) -> float:
        return self.ranks * 1000 / self.step_ms

    def label(self) -> str:
        gil = "GIL held" if self.hold_gil else "GIL released"
        return f"trainer loop, step {self.step_ms:g} ms ({gil}), {self.ranks} rank{'s' if self.ranks > 1 else ''}"


def _runs(settings: Settings) -> list[Run]:
    if settings.quick:
        return [Run(2.0, 2, False), Run(2.0, 2, True)]
    runs = [Run(d, w, gil) for gil in (False, True) for d in (5.0, 20.0) for w in (1, 2, 4)]
    return runs + [Run(1.0, w, False) for w in (1, 2, 4)]


def _dataset(ranks: int) -> str:
    return f"loop_w{ranks}"


def batches_per_file(settings: Settings) -> int:
    return settings.pick(100, 8)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    nb = batches_per_file(settings)
    names = ["loop_capacity", *sorted({_dataset(r.ranks) for r in _runs(settings)})]
    datasets = [
        dataset_toml(
            n,
            text=tokens.text_path,
            batch_size=B,
            block_size=T,
            batches_per_file=nb,
            backlog=BACKLOG,
        )
        for n in names
    ]
    return [ServerSpec("loop", tuple(datasets))]


def rank_main(
    address: str,
    dataset: str,
    rank: int,
    run: Run,
    warm_steps: int,
    steps: int,
    state: dict | None,
    barrier: Any,
    out: Any,
) -> None:
    """One trainer rank (runs in its own process)."""
    from queue_client import QueueClient

    try:
        client = QueueClient(address, dataset, rank=rank, world_size=run.ranks)
    except BaseException as exc:
        barrier.abort()
        out.put({"rank": rank, "error": repr(exc)})
        return
    try:
        if state is not None:
            client.load_state_dict(state)
        client.get_batch("train")
        barrier.wait(timeout=300)
        step_ns = int(run.step_ms * 1e6)
        now = time.perf_counter_ns
        waits = []
        boundary = []
        prefetched = 0
        began = 0
        for i in range(warm_steps + steps):
            if i == warm_steps:
                began = now()
            # Which calls open a file, and whether the prefetch was done by then: labels for
            # the samples, read before the call and outside the timed span.
            view = client.stream_view("train")
            crossing = view.opens_file
            ready = view.next_file == "ready"
            t0 = now()
            client.get_batch("train")
            t1 = now()
            if i >= warm_steps:
                waits.append(t1 - t0)
                if crossing:
                    boundary.append(t1 - t0)
                    prefetched += ready
            spin_until(t1 + step_ns, hold_gil=run.hold_gil)
        wall = now() - began
        out.put(
            {
                "rank": rank,
                "wall_s": wall / 1e9,
                "wait_s": sum(waits) / 1e9,
                "steps": steps,
                "max_wait_ms": max(waits) / 1e6,
                "stalls": sum(w > 1_000_000 for w in waits),
                "boundary_s": sum(boundary) / 1e9,
                "boundaries": len(boundary),
                "prefetched": prefetched,
                "state": client.state_dict(),
            }
        )
    except BaseException as exc:
        barrier.abort()
        out.put({"rank": rank, "error": repr(exc)})
    finally:
        client.close()


def _capacity(server: Server, settings: Settings) -> float:
    """Batches per second the provider makes for one rank that reads as fast as it can."""
    from queue_client import QueueClient

    nb = batches_per_file(settings)
    with QueueClient(server.address, "loop_capacity", rank=0, world_size=1) as client:
        walker = FileWalker(client, "train", nb, server, "loop_capacity", BACKLOG)
        walker.time_files(settings.pick(3, 1))  # drain the backlog made at start-up
        ns, n = walker.time_files(settings.pick(8, 2))
    return n / (ns / 1e9)


def _wait_quiet(server: Server, dataset: str, quiet_s: float = 0.5) -> None:
    """Wait until a dataset's provider has made nothing for quiet_s (a closed run's last files)."""
    last = {"n": -1, "t": time.monotonic()}

    def quiet() -> bool:
        n = server.split_stats(dataset)["produced_files"]
        if n != last["n"]:
            last["n"], last["t"] = n, time.monotonic()
        return time.monotonic() - last["t"] >= quiet_s

    wait_until(quiet, 120, f"{dataset} to go quiet", poll_s=0.05)


def _run(
    server: Server, settings: Settings, run: Run, states: list[dict] | None
) -> list[dict[str, Any]]:
    nb = batches_per_file(settings)
    dataset = _dataset(run.ranks)
    warm = nb
    steps = settings.pick(max(3 * nb, int(3000 / run.step_ms)), 2 * nb)
    ctx = procs.context()
    barrier = ctx.Barrier(run.ranks + 1)
    out = ctx.Queue()
    ranks = [
        ctx.Process(
            target=rank_main,
            args=(
                server.address,
                dataset,
                r,
                run,
                warm,
                steps,
                states[r] if states else None,
                barrier,
                out,
            ),
            daemon=True,
        )
        for r in range(run.ranks)
    ]
    for p in ranks:
        p.start()
    reports: list[dict[str, Any]] = []
    try:
        barrier.wait(timeout=300)
        deadline = time.monotonic() + 120 + (warm + steps) * run.step_ms / 1000 * 3
        while len(reports) < run.ranks:
            try:
                reports.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
            except queue_mod.Empty:
                raise TimeoutError(f"ranks of {dataset} did not report in time") from None
    except BaseException:
        for p in ranks:
            if p.is_alive():
                p.terminate()
        raise
    finally:
        for p in ranks:
            p.join(timeout=60)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{run.label()}: {errors[0]}")
    _wait_quiet(server, dataset)
    return sorted(reports, key=lambda r: r["rank"])


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    server = found["loop"]
    runs = _runs(settings)
    for name in sorted({_dataset(r.ranks) for r in runs}):  # start-up production done first
        server.wait_ready_files(name, BACKLOG + 2)
    capacity = _capacity(server, settings)
    _wait_quiet(server, "loop_capacity")
    results = [
        Result(
            "5",
            f"provider capacity, 1 worker, B={B} T={T}, consumer idle",
            capacity,
            "batches/s",
            note="one rank reading whole files back to back; a run's demand is ranks*1000/d",
        )
    ]
    states: dict[int, list[dict]] = {}
    for r in runs:
        reports = _run(server, settings, r, states.get(r.ranks))
        states[r.ranks] = [rep["state"] for rep in reports]
        pcts = [100 * rep["wait_s"] / rep["wall_s"] for rep in reports]
        worst = max(pcts)
        achieved = sum(rep["steps"] / rep["wall_s"] for rep in reports)
        n_boundaries = sum(rep["boundaries"] for rep in reports)
        at_boundaries = sum(rep["boundary_s"] for rep in reports) / max(
            sum(rep["wait_s"] for rep in reports), 1e-12
        )
        note = (
            f"mean over ranks {sum(pcts) / len(pcts):.2f}%; got {fmt(achieved)} batches/s of {fmt(r.demand)} asked; "
            f"worst stall {max(rep['max_wait_ms'] for rep in reports):.1f} ms, {sum(rep['stalls'] for rep in reports)} calls > 1 ms; "
            f"{100 * at_boundaries:.0f}% of the waiting in the {n_boundaries} calls that opened a file "
            f"(mean {1e3 * sum(rep['boundary_s'] for rep in reports) / max(n_boundaries, 1):.1f} ms; "
            f"prefetch done before {sum(rep['prefetched'] for rep in reports)} of them)"
        )
        keeps_up = r.demand < capacity
        results.append(
            Result(
                "5",
                f"{r.label()}: waiting for data",
                worst,
                "% (worst rank)",
                "demand",
                r.demand,
                "batches/s",
                r.demand / capacity,
                "x capacity",
                f"< {GOAL_PCT:g}%" if keeps_up else "info",
                worst < GOAL_PCT if keeps_up else None,
                note,
                extra={
                    "reports": [{k: v for k, v in rep.items() if k != "state"} for rep in reports]
                },
            )
        )
    return results
