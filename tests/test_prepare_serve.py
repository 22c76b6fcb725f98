"""A corpus prepared by queue-prepare, served by token_shards to a trainer's QueueClient: the
prepared format as the provider reads it, end to end with a real server. Every row the
client gets is a window of the prepared token stream (x, and y one token on), and meta
carries the manifest's vocab_size and eos_id."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from conftest import ServerFactory
from queue_providers.prepare import main

T = 32


def prepared(tmp_path: Path, name: str, docs: list[str]) -> Path:
    corpus = tmp_path / f"{name}.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "shards" / name
    args = ["--input", str(corpus), "--separator", "", "--out", str(out), "--no-progress"]
    assert main([*args, "--shard-tokens", "1024", "--workers", "2"]) == 0
    return out


def stream(out: Path) -> np.ndarray:
    return np.concatenate(
        [np.load(p, allow_pickle=False) for p in sorted(out.glob("shard-*[0-9].npy"))]
    )


def test_a_prepared_corpus_is_served_by_token_shards(
    tmp_path: Path, start_server: ServerFactory
) -> None:
    from queue_client import QueueClient

    train = prepared(
        tmp_path, "train", [f"train document {i} " + "word " * (i % 23) for i in range(300)]
    )
    val = prepared(tmp_path, "val", [f"val document {i} " + "text " * (i % 11) for i in range(60)])
    config = textwrap.dedent(
        f"""
        [datasets.web]
        provider = "token_shards"
        batch_size = 4
        batches_per_file = 2
        seed = 1
        [datasets.web.args]
        inputs = {{ train = ["{train / "manifest.json"}"], val = ["{val}"] }}
        block_size = {T}
        """
    )
    server = start_server(config)
    windows = {
        split: np.lib.stride_tricks.sliding_window_view(stream(out), T + 1)
        for split, out in (("train", train), ("val", val))
    }
    with QueueClient(server.address, "web", timeout_s=60) as client:
        assert client.meta["vocab_size"] == 257 and client.meta["eos_id"] == 256
        for split in ("train", "val"):
            for _ in range(3):
                x, y = client.get_batch(split)
                assert x.shape == (4, T) and (y[:, :-1] == x[:, 1:]).all()
                rows = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1)
                for row in rows:
                    assert (windows[split] == row).all(axis=1).any(), (
                        f"{split} row not in its corpus"
                    )
