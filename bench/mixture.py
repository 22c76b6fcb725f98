"""Row 16: a weighted mixture of pre-tokenized corpora, as a worker makes its files.

Three token_shards sources (the suite's train ids, each rolled to another start), weights
0.5, 0.3 and 0.2. Each file takes its rows from the sources' own files; a source's file is
made once and its rows spread over the mixture files that take them, so a mixture's work per
file is about one source file's plus the mixing.

16a: the mixture as its workers make files (the sources' stored rows copied, with numpy)
beside one source alone making files of the same size: the cost of mixing.
16b: the same mixture made the general way (every source row decoded to its served fields,
checked and encoded again), which any source kind can take, beside 16a.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.data import Tokens
from bench.harness import Result, Settings, median
from bench.servers import Server, ServerSpec

SEED = 1337
B, T = 12, 1024
WEIGHTS = (0.5, 0.3, 0.2)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # in-process: no server


def _sources(tokens: Tokens, directory: Path) -> list[dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    ids = np.fromfile(tokens.train_bin, dtype=np.uint16)
    out = []
    for i, weight in enumerate(WEIGHTS):
        path = directory / f"corpus_{i}.bin"
        np.roll(ids, i * len(ids) // len(WEIGHTS)).tofile(path)
        args = {"inputs": [str(path)], "block_size": T, "vocab_size": tokens.vocab_size}
        out.append({"name": f"c{i}", "provider": "token_shards", "weight": weight, "args": args})
    return out


def _provider(directory: Path, nb: int, name: str, args: dict[str, Any]) -> Any:
    from queue_providers import ProviderContext, create

    ctx = ProviderContext(directory.name, directory, batch_size=B, batches_per_file=nb, seed=SEED)
    provider = create(name, ctx, args)
    provider.set_meta(provider.complete_meta())
    return provider


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    import torch

    root = settings.workdir / "mixture"
    sources = _sources(tokens, root / "corpora")
    nb, files = settings.pick(100, 2), settings.pick(4, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a worker process
    try:
        copied = _provider(root / "copied", nb, "mixture", {"sources": sources})
        decoded = _provider(root / "decoded", nb, "mixture", {"sources": sources})
        decoded.copies_stored_rows = lambda split: False  # the way any source kind takes
        alone = _provider(root / "alone", nb, "token_shards", sources[0]["args"])
        makers = {"copied": copied, "decoded": decoded, "alone": alone}
        rates: dict[str, list[float]] = {k: [] for k in makers}
        for who in makers.values():
            who.make_file("train", 0)  # maps opened, pages warm
        seq = 1
        for r in range(settings.repeats):
            order = list(makers)
            for key in order[r % 3 :] + order[: r % 3]:
                began = time.thread_time()
                for k in range(files):
                    makers[key].make_file("train", seq + k)
                rates[key].append(files * B * T * nb / (time.thread_time() - began))
            seq += files
    finally:
        torch.set_num_threads(threads)
    value, alone_rate, slow = (median(rates[k]) for k in ("copied", "alone", "decoded"))
    shape = f"B*T={B * T}, {nb} batches per file, 3 token_shards sources"
    return [
        Result(
            "16",
            f"mixture, make_file, {shape}",
            value / 1e6,
            "M tokens/s",
            "one source alone",
            alone_rate / 1e6,
            "M tokens/s",
            value / alone_rate,
            "x one source",
            "info",
            None,
            "the sources' stored rows copied with numpy (no torch in the worker); CPU time "
            "of one thread",
            extra={"rates": rates},
        ),
        Result(
            "16",
            f"mixture decoding and encoding its rows, make_file, {shape}",
            slow / 1e6,
            "M tokens/s",
            "16a, rows copied",
            value / 1e6,
            "M tokens/s",
            slow / value,
            "x 16a",
            "info",
            None,
            "the general way, for sources whose rows are not stored row by row (text_lm)",
        ),
    ]
