"""The GPU session's data: token corpora it writes itself, the shapes it measures, and the
queue server that serves them (on a unix socket, under the session's work dir).

One corpus of GPT-2-sized ids (uint16, nanoGPT's train.bin format) is read by a token_shards
dataset, by nanoGPT's get_batch, and cut into the stored windows the transfer-only figures
copy; three more corpora make a three-source token_shards mixture. Every shape has its own
datasets (`lm_B_T`, `mix_B_T`), all on one server per part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.servers import Server, ServerSpec

VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT pads it
MIX_WEIGHTS = (0.5, 0.3, 0.2)


@dataclass(frozen=True)
class Shape:
    """One trainer's batch: B rows of T tokens."""

    batch_size: int
    block_size: int

    @property
    def key(self) -> str:
        return f"{self.batch_size}_{self.block_size}"

    @property
    def label(self) -> str:
        return f"B={self.batch_size} T={self.block_size}"


@dataclass(frozen=True)
class Sizes:
    """How big everything is: the real session's on a GPU, or the dry run's on a CPU."""

    shapes: tuple[Shape, ...]
    vocab: int
    corpus_tokens: int
    source_tokens: int
    batches_per_file: int
    backlog: int
    workers: int


GPU_SIZES = Sizes(
    shapes=(Shape(12, 1024), Shape(64, 256)),
    vocab=VOCAB,
    corpus_tokens=16_000_000,
    source_tokens=4_000_000,
    batches_per_file=50,
    backlog=8,
    workers=2,
)
DRY_SIZES = Sizes(
    shapes=(Shape(4, 32), Shape(8, 16)),
    vocab=512,
    corpus_tokens=200_000,
    source_tokens=50_000,
    batches_per_file=8,
    backlog=2,
    workers=1,
)


def write_corpora(root: Path, sizes: Sizes) -> dict[str, Path]:
    """train.bin and the three mixture sources, seeded; returns name -> path."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {"lm": root / "train.bin"}
    paths.update({f"src{i}": root / f"source_{i}.bin" for i in range(len(MIX_WEIGHTS))})
    for i, (name, path) in enumerate(paths.items()):
        if path.exists():
            continue
        n = sizes.corpus_tokens if name == "lm" else sizes.source_tokens
        rng = np.random.default_rng(1337 + i)
        tmp = path.with_suffix(".tmp")
        rng.integers(0, sizes.vocab, size=n, dtype=np.uint16).tofile(tmp)
        tmp.rename(path)
    return paths


def _table(name: str, shape: Shape, sizes: Sizes) -> str:
    return (
        f"[datasets.{name}]\n"
        f"batch_size = {shape.batch_size}\n"
        f"batches_per_file = {sizes.batches_per_file}\n"
        f"max_backlog_files = {sizes.backlog}\n"
        f"workers = {sizes.workers}\n"
    )


def _shards_args(prefix: str, path: Path, shape: Shape, sizes: Sizes) -> str:
    return (
        f"[{prefix}.args]\n"
        f"inputs = [{json.dumps(str(path))}]\n"
        f"block_size = {shape.block_size}\n"
        f"vocab_size = {sizes.vocab}\n"
    )


def datasets(corpora: dict[str, Path], sizes: Sizes, *, mixtures: bool) -> tuple[str, ...]:
    """TOML tables: per shape a token_shards dataset `lm_B_T` and, with `mixtures`, a
    three-source mixture `mix_B_T` (weights 0.5/0.3/0.2)."""
    out = []
    for shape in sizes.shapes:
        name = f"lm_{shape.key}"
        table = _table(name, shape, sizes) + 'provider = "token_shards"\n'
        out.append(table + _shards_args(f"datasets.{name}", corpora["lm"], shape, sizes))
        if not mixtures:
            continue
        name = f"mix_{shape.key}"
        table = _table(name, shape, sizes)
        for i, weight in enumerate(MIX_WEIGHTS):
            prefix = f"datasets.{name}.sources.s{i}"
            table += f'[{prefix}]\nprovider = "token_shards"\nweight = {weight}\n'
            table += _shards_args(prefix, corpora[f"src{i}"], shape, sizes)
        out.append(table)
    return tuple(out)


def start_server(
    workdir: Path, corpora: dict[str, Path], sizes: Sizes, *, mixtures: bool
) -> Server:
    """A queue server of the session's datasets on a unix socket, serving."""
    spec = ServerSpec("gpu", datasets(corpora, sizes, mixtures=mixtures), transport="unix")
    server = Server(spec, workdir)
    try:
        server.wait_serving(180.0)
    except BaseException:
        server.stop()
        raise
    return server


def windows(path: Path, shape: Shape, count: int) -> np.ndarray:
    """`count` stored batches cut from a corpus as a file holds them: uint16 [count, B, T+1]."""
    ids = np.fromfile(
        path, dtype=np.uint16, count=count * shape.batch_size * (shape.block_size + 1)
    )
    return ids.reshape(count, shape.batch_size, shape.block_size + 1)
