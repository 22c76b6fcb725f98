"""Row 14: token_shards' tokens per second per worker, beside the file's floor; and its start
at a terabyte beside its start at 100 MB.

14a, 14b: a worker's whole job is make_file. The corpus is the suite's train ids cut into
four llm.c shards; each file is one epoch-ordered (14a) or nanoGPT-random (14b) draw of
B*nb windows of T+1 tokens. The floor is a plain numpy read of the very same windows from
the same memory maps (one fancy index per shard into an array), so the ratio is what the
order, the id check, the stacking and the encoding cost on top of reading the tokens.

14c: what a worker does at start (build the provider: expand the inputs, read each header;
then meta and the inputs fingerprint) for a terabyte of sparse shards (four 256 GiB raw .bin
files; they take no disk) beside a 100 MB corpus. The goal is the same time within 10%
(plus 20 ms, for the noise of a shared machine).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median
from bench.servers import Server, ServerSpec

SEED = 1337
B, T = 12, 1024
SHARDS = 4
GIB = 1 << 30


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # in-process: no server


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    root = settings.workdir / "token_shards"
    inputs = _llmc_shards(tokens.train_bin, root / "llmc")
    nb = settings.pick(20, 2)
    files = settings.pick(3, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a worker process
    try:
        nanogpt = _provider(
            root / "nanogpt",
            {
                "data_dir": str(tokens.train_bin.parent),
                "block_size": T,
                "splits": ["train"],
                "vocab_size": tokens.vocab_size,
            },
            nb,
            "nanogpt_bin",
        )
        results = [
            _serving(settings, root, inputs, tokens.vocab_size, sampling, nb, files, nanogpt)
            for sampling in ("epoch", "random")
        ]
        results.append(_start_up(settings, root))
    finally:
        torch.set_num_threads(threads)
    return results


def _serving(
    settings: Settings,
    root: Path,
    inputs: list[str],
    vocab: int,
    sampling: str,
    nb: int,
    files: int,
    nanogpt: Any,
) -> Result:
    provider = _provider(
        root / sampling,
        {"inputs": inputs, "block_size": T, "vocab_size": vocab, "sampling": sampling},
        nb,
    )
    provider.make_file("train", 0)  # maps opened, pages warm
    per_file = B * nb * T
    rates, floors, twins = [], [], []
    seq = 1
    for _ in range(settings.repeats):
        for who, into in ((provider, rates), (nanogpt, twins)):
            began = time.perf_counter()
            for k in range(files):
                who.make_file("train", seq + k)
            into.append(files * per_file / (time.perf_counter() - began))
        floors.append(files * per_file / _floor_seconds(provider, seq, files, nb))
        seq += files
    value, floor, twin = median(rates), median(floors), median(twins)
    return Result(
        "14",
        f"token_shards {sampling}, make_file, B*T={B * T}, {nb} batches per file, {SHARDS} llm.c shards",
        value / 1e6,
        "M tokens/s",
        "numpy read of the same windows",
        floor / 1e6,
        "M tokens/s",
        value / floor,
        "x floor",
        "info",
        None,
        (
            "the floor reads the windows the provider chose, from the same memory maps"
            if sampling == "epoch"
            else "the floor reads as many windows drawn the same way (its own seeds)"
        )
        + f"; nanogpt_bin on the same ids, same repeats: {fmt(twin / 1e6)} M tokens/s",
        extra={"rates": rates, "floors": floors, "nanogpt_bin": twins},
    )


def _floor_seconds(provider: Any, seq: int, files: int, nb: int) -> float:
    """A plain numpy read of the windows of `files` files: where they are, chosen as the
    provider chose them, then one fancy index per shard (none of this timed but the read)."""
    corpus = provider.corpora["train"]
    maps = [provider.shard_tokens("train", i) for i in range(len(corpus.shards))]
    plans = []
    for k in range(files):
        rows = np.arange((seq + k) * B * nb, (seq + k + 1) * B * nb)
        if provider.sampling == "epoch":
            shard, start = corpus.locate(provider.orders["train"].windows(rows))
        else:
            gen = np.random.default_rng(seq + k)
            shard, start = corpus.locate_start(gen.integers(0, corpus.n_starts, len(rows)))
        plans.append([(maps[i], start[shard == i]) for i in np.unique(shard).tolist()])
    offsets = np.arange(T + 1)
    began = time.perf_counter()
    for plan in plans:
        for tokens, starts in plan:
            np.asarray(tokens[starts[:, None] + offsets])
    return time.perf_counter() - began


def _start_up(settings: Settings, root: Path) -> Result:
    small = root / "small"
    small.mkdir(parents=True, exist_ok=True)
    small_tokens = settings.pick(50_000_000, 5_000_000)  # 100 MB (10 MB in the smoke version)
    (np.arange(small_tokens, dtype=np.int64) % 50257).astype(np.uint16).tofile(small / "train.bin")
    big = root / "big"
    big.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        with open(big / f"part{i}.bin", "wb") as f:
            f.truncate(256 * GIB)
    cases = {"big": [str(big / "*.bin")], "small": [str(small / "train.bin")]}
    times: dict[str, list[float]] = {"big": [], "small": []}
    for r in range(max(settings.repeats, 3)):
        for name in list(cases)[r % 2 :] + list(cases)[: r % 2]:
            began = time.perf_counter()
            _provider(root / f"start-{name}", {"inputs": cases[name], "block_size": T}, 10)
            times[name].append(time.perf_counter() - began)
    big_s, small_s = median(times["big"]), median(times["small"])
    return Result(
        "14",
        "token_shards start (inputs, headers, meta, fingerprint), 1 TiB of sparse shards",
        big_s * 1e3,
        "ms",
        f"the same for a {small_tokens * 2 // 10**6} MB corpus",
        small_s * 1e3,
        "ms",
        big_s / small_s,
        "x the small corpus's start",
        "<= 1.1x + 20 ms",
        big_s <= 1.1 * small_s + 0.02,
        f"{fmt(4 * 256 * GIB / 2 / 1e9)} G tokens against {fmt(small_tokens / 1e9)} G",
        extra={"big_s": times["big"], "small_s": times["small"]},
    )


def _provider(directory: Path, args: dict[str, Any], nb: int, name: str = "token_shards") -> Any:
    from queue_providers import ProviderContext, create

    ctx = ProviderContext(directory.name, directory, batch_size=B, batches_per_file=nb, seed=SEED)
    provider = create(name, ctx, args)
    provider.set_meta(provider.complete_meta())
    return provider


def _llmc_shards(train_bin: Path, directory: Path) -> list[str]:
    """The suite's train ids as SHARDS llm.c shards (header, then uint16 ids)."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = np.fromfile(train_bin, dtype=np.uint16)
    for i, part in enumerate(np.array_split(ids, SHARDS)):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240520, 1, len(part))
        with open(directory / f"train_{i:06d}.bin", "wb") as f:
            f.write(header.tobytes())
            f.write(part.astype("<u2").tobytes())
    return [str(directory / "train_*.bin")]
