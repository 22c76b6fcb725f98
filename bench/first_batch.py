"""Row 3: the first batch of a new file, with and without the background prefetch.

With prefetch the next file was leased, crc-checked and mapped by the client's background
thread while the current one was read, so the call that crosses the boundary only swaps it in
and queues the next prefetch. Without it, that call makes the AcquireLease RPC, reads the whole
file for its crc32 and maps it. In both cases the file is already on disk (the provider's
backlog is full before each timed call), so this is the client's cost, not the provider's.
"""

from __future__ import annotations

from bench.data import Tokens
from bench.harness import Result, Settings, median, percentile
from bench.servers import Server, ServerSpec, dataset_toml
from bench.walker import FileWalker

B, T = 12, 1024
BACKLOG = 2


def batches_per_file(settings: Settings) -> int:
    return settings.pick(100, 8)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    nb = batches_per_file(settings)
    datasets = [
        dataset_toml(
            name,
            text=tokens.text_path,
            batch_size=B,
            block_size=T,
            batches_per_file=nb,
            backlog=BACKLOG,
        )
        for name in ("first_prefetch", "first_no_prefetch")
    ]
    return [ServerSpec("first", tuple(datasets))]


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    from queue_client import QueueClient

    server = found["first"]
    nb = batches_per_file(settings)
    samples: dict[bool, list[float]] = {True: [], False: []}
    clients = {
        p: QueueClient(
            server.address,
            "first_prefetch" if p else "first_no_prefetch",
            rank=0,
            world_size=1,
            prefetch=p,
        )
        for p in (True, False)
    }
    try:
        walkers = {
            p: FileWalker(c, "train", nb, server, c.dataset, BACKLOG) for p, c in clients.items()
        }
        for w in walkers.values():  # the very first file also pays for GetMeta-era set-up: skip it
            w.open_next()
        for _ in range(settings.pick(max(9, settings.repeats), 2)):
            for prefetch, w in walkers.items():
                w.finish_file()
                w.settle()
                samples[prefetch].append(w.open_next() / 1e3)
    finally:
        for c in clients.values():
            c.close()
    with_p, without = median(samples[True]), median(samples[False])
    file_mb = 2 * B * T * 8 * nb / 1e6
    return [
        Result(
            "3",
            f"first batch of a new file, prefetch on (B={B} T={T}, {file_mb:.0f} MB files)",
            with_p,
            "µs p50",
            "prefetch off",
            without,
            "µs p50",
            without / with_p,
            "x faster",
            "info",
            None,
            f"max {percentile(samples[True], 100):.0f} µs on, {percentile(samples[False], 100):.0f} µs off; {len(samples[True])} files each",
        ),
    ]
