"""A corpus prepared by queue-prepare, served by token_shards to a trainer's QueueClient: the
prepared format as the provider reads it, end to end with a real server. Every row the
client gets is a window of the prepared token stream (x, and y one token on), and meta
carries the manifest's vocab_size and eos_id."""

from __future__ import annotations

import re
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


def _documents_served(client: object, split: str, rows: int) -> np.ndarray:
    """input_ids of the first `rows` rows of `split`, in order, checked as text_lm's fields."""
    got, seen = [], 0
    while seen < rows:
        batch = client.get_batch(split)  # type: ignore[attr-defined]
        ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
        inside = labels[:, :-1] != -100
        assert (labels[:, :-1][inside] == ids[:, 1:][inside]).all()
        assert ((labels == -100) == (ids == 256)).all()  # no target past a document's end
        got.append(ids)
        seen += len(ids)
    return np.concatenate(got)[:rows]


def test_documents_cut_by_a_shard_end_are_served_whole(
    tmp_path: Path, start_server: ServerFactory
) -> None:
    """order = "documents" on a prepared corpus whose documents run on into the next shards
    (one longer than a shard, so a shard has no document start): every epoch packs whole
    documents, each at most once, with text_lm's fields (eos_id from the manifest)."""
    from queue_client import QueueClient

    docs = [f"doc {i:03d} " + "word " * (i % 37) for i in range(240)]
    docs[100] = "doc 100 " + "long " * 500  # 2,508 byte tokens: past a whole shard
    train = prepared(tmp_path, "train", docs)
    pieces = [np.frombuffer(d.encode(), np.uint8).astype(np.int64) for d in docs]
    by_number = {i: np.append(p, 256) for i, p in enumerate(pieces)}
    config = textwrap.dedent(
        f"""
        [datasets.web]
        provider = "token_shards"
        batch_size = 4
        batches_per_file = 2
        [datasets.web.args]
        inputs = ["{train}"]
        block_size = {T}
        order = "documents"
        """
    )
    server = start_server(config)
    with QueueClient(server.address, "web", timeout_s=60) as client:
        n = client.meta["split_info"]["train"]["windows"]
        rows = _documents_served(client, "train", 2 * n)
    heads = re.compile(rb"doc (\d{3}) ")
    epochs = []
    for epoch in (rows[:n], rows[n:]):
        for row in epoch:
            # A window is one shard's stream: after each EOS in it a whole document begins.
            ends = np.flatnonzero(row == 256) + 1
            for piece in np.split(row, ends)[1:]:
                start = bytes(np.minimum(piece[:8], 255).astype(np.uint8))
                head = heads.match(start)
                if head is None:  # the window ends inside a document's head
                    assert b"doc ".startswith(start) or re.fullmatch(rb"doc \d{1,3}", start)
                    continue
                assert np.array_equal(by_number[int(head.group(1))][: len(piece)], piece)
        # Consecutive windows of a shard follow each other, and each stream starts with a
        # document: each document's head is seen whole, once per epoch at most.
        text = bytes(np.minimum(epoch.reshape(-1), 255).astype(np.uint8))
        served = [int(m.group(1)) for m in heads.finditer(text)]
        assert len(served) == len(set(served))
        assert len(served) >= len(docs) - 2 * len(list(train.glob("shard-*[0-9].npy")))
        assert 100 in served  # the document longer than a shard
        epochs.append(served)
    assert epochs[0] != epochs[1]  # another order each epoch
