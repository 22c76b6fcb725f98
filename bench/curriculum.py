"""Row 8: get_batch with curriculum selection on, beside the same dataset served FIFO.

Both datasets are char_lm over the same text with the same shapes and one provider worker;
the curriculum one picks every served batch from a buffer of candidates (docs/curriculum.md).
In a rotating order each repeat times the rest of one file (steady in a file, after the next
file is prefetched and the producer idles) and the call that opens the next file. Figures are
medians over repeats; the amortised figures (8c) read many files back to back and so are
bound by the producer: the provider alone for FIFO; for the curriculum the provider making
`candidate_oversample` (2) candidate batches per served batch, with their histograms, and the
composer picking and copying. 8c's goal: the curriculum at 0.8x FIFO's rate or better.
The composer alone on a big vocabulary is bench/composer_scale.py (8d-8f).
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import composer_scale
from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median
from bench.servers import Server, ServerSpec, dataset_toml
from bench.walker import FileWalker

B, T = 12, 1024
BACKLOG = 2
GOAL = 1.10
GOAL_RATE = 0.80  # 8c: curriculum batches/s over FIFO's
FIFO, CURRICULUM = "curriculum_off", "curriculum_on"


def batches_per_file(settings: Settings) -> int:
    return settings.pick(50, 8)


def _cpu_s(server_pid: int) -> dict[int, float]:
    """CPU seconds so far of the server and every process under it, by pid."""
    from bench.grain_peer import children

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in (server_pid, *children(server_pid)):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_per_batch(
    server: Server, name: str, before: dict[int, float], after: dict[int, float], batches: int
) -> dict[str, float]:
    """CPU ms per served batch while `name` was read: its provider workers (a curriculum's
    candidate makers), its composer, the server, and the rest (the other dataset idles with
    a full backlog)."""
    roles = {
        int(w["pid"]): "composer" if w["role"] == "composer" else "provider"
        for w in server.split_stats(name)["workers"]
        if w.get("pid")
    }
    spent = {"provider": 0.0, "composer": 0.0, "server": 0.0, "rest": 0.0}
    for pid, cpu in after.items():
        role = roles.get(pid, "server" if pid == server.pid else "rest")
        spent[role] += cpu - before.get(pid, 0.0)
    return {role: 1e3 * s / max(batches, 1) for role, s in spent.items()}


def _cpu_note(cpu_ms: dict[str, dict[str, float]]) -> str:
    """Where the rate goes: each dataset has one provider worker, and the curriculum's makes
    candidate_oversample candidates per served batch, which its composer then picks from."""
    fifo, cur = cpu_ms[FIFO], cpu_ms[CURRICULUM]
    note = (
        f"CPU per served batch: provider worker {fmt(cur['provider'])} ms (FIFO's "
        f"{fmt(fifo['provider'])} ms), composer {fmt(cur['composer'])} ms, server "
        f"{fmt(cur['server'])} ms (FIFO's {fmt(fifo['server'])} ms), the rest "
        f"{fmt(cur['rest'])} ms"
    )
    for role in ("provider", "composer"):
        if cur[role] > 0:
            # FIFO's one worker is its bottleneck; the curriculum's worker and its composer
            # each run in one process, so each alone caps its rate at this fraction of that.
            note += f"; its {role} alone caps it at {fifo['provider'] / cur[role]:.2f}x FIFO's rate"
    return note


def _curriculum_keys(settings: Settings) -> str:
    buffer = settings.pick(1000, 32)
    tokens = settings.pick(2_000_000, 20_000)
    return (
        'selection = "curriculum"\n'
        f"candidate_buffer = {buffer}\n"
        f"starting_estimation_token_count = {tokens}\n"
    )


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    nb = batches_per_file(settings)
    common = dict(
        text=tokens.text_path, batch_size=B, block_size=T, batches_per_file=nb, backlog=BACKLOG
    )
    fifo = dataset_toml(FIFO, **common)
    cur = dataset_toml(CURRICULUM, **common)
    args_at = cur.index(f"[datasets.{CURRICULUM}.args]")
    cur = cur[:args_at] + _curriculum_keys(settings) + cur[args_at:]
    return [ServerSpec("curriculum", (fifo, cur))]


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    from queue_client import QueueClient

    server = found["curriculum"]
    nb = batches_per_file(settings)
    files = settings.pick(8, 2)
    steady: dict[str, list[float]] = {FIFO: [], CURRICULUM: []}
    opening: dict[str, list[float]] = {FIFO: [], CURRICULUM: []}
    clients = {name: QueueClient(server.address, name) for name in (FIFO, CURRICULUM)}
    try:
        walkers = {
            name: FileWalker(client, "train", nb, server, name, BACKLOG)
            for name, client in clients.items()
        }
        order = [FIFO, CURRICULUM]
        for r in range(settings.repeats):
            for name in order[r % 2 :] + order[: r % 2]:
                walker = walkers[name]
                walker.finish_file()
                walker.settle()
                opening[name].append(walker.open_next() / 1e3)
                walker.settle()
                ns, n = walker.time_rest_of_file()
                steady[name].append(ns / max(n, 1) / 1e3)
        amortised = {}
        cpu_ms: dict[str, dict[str, float]] = {}
        for name, walker in walkers.items():
            walker.time_files(BACKLOG + 1)  # what was made ahead while idle
            before = _cpu_s(server.pid)
            ns, n = walker.time_files(files)
            cpu_ms[name] = _cpu_per_batch(server, name, before, _cpu_s(server.pid), n)
            amortised[name] = ns / max(n, 1) / 1e3
        stats = server.split_stats(CURRICULUM).get("curriculum", {})
    finally:
        for client in clients.values():
            client.close()
    s_fifo, s_cur = median(steady[FIFO]), median(steady[CURRICULUM])
    o_fifo, o_cur = median(opening[FIFO]), median(opening[CURRICULUM])
    shape = f"B={B} T={T}"
    return [
        Result(
            "8",
            f"get_batch {shape}, steady in a file, curriculum on",
            s_cur,
            "µs/batch",
            "the same, FIFO",
            s_fifo,
            "µs/batch",
            s_cur / s_fifo,
            "x FIFO",
            f"<= {GOAL:.2f}x",
            s_cur / s_fifo <= GOAL,
            "the served file is a plain batch file: the hot path is the same code",
        ),
        Result(
            "8",
            f"get_batch {shape}, first batch of a prefetched file, curriculum on",
            o_cur,
            "µs",
            "the same, FIFO",
            o_fifo,
            "µs",
            o_cur / o_fifo,
            "x FIFO",
            "info",
            None,
            "one lease release and a prefetch hand-over per file",
        ),
        Result(
            "8",
            f"get_batch {shape}, amortised over {files} files of {nb} (producer-bound)",
            amortised[CURRICULUM],
            "µs/batch",
            "the same, FIFO",
            amortised[FIFO],
            "µs/batch",
            amortised[FIFO] / amortised[CURRICULUM],
            "x FIFO's rate",
            f">= {GOAL_RATE:.2f}x",
            amortised[FIFO] / amortised[CURRICULUM] >= GOAL_RATE,
            f"composer + provider {fmt(1e6 / amortised[CURRICULUM])} batches/s, provider alone "
            f"{fmt(1e6 / amortised[FIFO])}; buffer {stats.get('buffer_batches', '?')} batches; "
            + _cpu_note(cpu_ms),
        ),
        *composer_scale.run(settings),
    ]
