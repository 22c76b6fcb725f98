"""A mixture's file made by copying the stored rows of its sources' files: the bytes that
decoding those rows and encoding them again makes, for every source kind whose rows are
stored row by row; any other source goes the decoding way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from queue_client.format.batchfile import load_batch_bytes
from queue_providers import ProviderContext
from queue_providers.mixture import MixtureProvider

B, NB = 3, 4


def _bin_dir(tmp: Path, name: str, vocab: int, dtype: type, start: int) -> Path:
    d = tmp / name
    d.mkdir()
    ids = (np.arange(start, start + 3_000) * 7 % vocab).astype(dtype)
    for split in ("train", "val"):
        ids.tofile(d / f"{split}.bin")
    return d


def _sources(tmp: Path, kind: str) -> list[dict[str, Any]]:
    """Two sources of one schema and a third weight-less one, by kind."""
    if kind == "nanogpt_bin-uint32":
        vocab, dtype = 70_000, np.uint32
    else:
        vocab, dtype = 300, np.uint16
    dirs = [_bin_dir(tmp, n, vocab, dtype, start) for n, start in (("a", 0), ("b", 5))]
    if kind.startswith("nanogpt_bin"):
        return [
            {"name": n, "provider": "nanogpt_bin", "weight": w,
             "args": {"data_dir": str(d), "block_size": 8, "vocab_size": vocab}}
            for n, w, d in zip("ab", (0.7, 0.3), dirs, strict=True)
        ]  # fmt: skip
    return [  # token_shards in window order, one random sampling beside one epoch order
        {"name": "a", "provider": "token_shards", "weight": 0.6,
         "args": {"inputs": [str(dirs[0] / "train.bin")], "block_size": 8, "vocab_size": vocab}},
        {"name": "b", "provider": "token_shards", "weight": 0.4,
         "args": {"inputs": [str(dirs[1] / "train.bin")], "block_size": 8, "vocab_size": vocab,
                  "sampling": "random"}},
    ]  # fmt: skip


def _mixture(tmp: Path, sources: list[dict[str, Any]], name: str) -> MixtureProvider:
    context = ProviderContext("mix", tmp / name, batch_size=B, batches_per_file=NB, seed=7)
    mixture = MixtureProvider(context, sources=sources, schedule=[(40, [0.2, 0.8])])
    mixture.set_meta(mixture.complete_meta())
    return mixture


@pytest.mark.parametrize("kind", ["nanogpt_bin", "nanogpt_bin-uint32", "token_shards"])
def test_copied_stored_rows_make_the_bytes_decoding_makes(tmp_path: Path, kind: str) -> None:
    sources = _sources(tmp_path, kind)
    copied = _mixture(tmp_path, sources, "copied")
    decoded = _mixture(tmp_path, sources, "decoded")
    assert copied.copies_stored_rows("train")
    decoded.copies_stored_rows = lambda split: False  # type: ignore[method-assign]
    picked = set()
    for seq in range(6):  # across the schedule's change of weights
        a, b = copied.make_file("train", seq), decoded.make_file("train", seq)
        assert a.data == b.data, f"file {seq}"
        assert a.epoch_starts == b.epoch_starts
        picked |= set(load_batch_bytes(a.data, "f").tensors["source"].flatten().tolist())
    assert picked == {0, 1}


def test_a_source_of_packed_documents_is_decoded_and_encoded(tmp_path: Path) -> None:
    """text_lm stores where documents end per batch, beside the ids: no row-by-row copy."""
    text = tmp_path / "t.txt"
    text.write_text("hello world, the queue serves\n\n" * 80, encoding="utf-8")
    args = {"source": str(text), "seq_len": 8, "micro_batch_size": 2, "separator": "",
            "tokenizer": "byte", "eval_take": 5}  # fmt: skip
    sources = [
        {"name": "web", "provider": "text_lm", "weight": 1.0, "args": args},
        {"name": "more", "provider": "text_lm", "weight": 1.0, "args": args},
    ]
    mixture = _mixture(tmp_path, sources, "docs")
    assert not mixture.copies_stored_rows("train")  # its eos exceptions are per batch
    made = load_batch_bytes(mixture.make_file("train", 0).data, "f").tensors
    assert set(made["source"].flatten().tolist()) <= {0, 1}


@pytest.mark.parametrize("kind", ["nanogpt_bin-uint32", "token_shards", "char_lm"])
def test_a_window_provider_hands_over_what_its_file_stores(tmp_path: Path, kind: str) -> None:
    """stored_tensors (what a mixture copies rows from) is what make_file encodes: the same
    names, dtypes and values, for either sampling of token_shards and for char_lm."""
    from queue_client.format import batchfile_v3
    from queue_client.format.batchfile import FORMAT_VERSION
    from queue_providers import create

    if kind == "char_lm":
        (tmp_path / "c.txt").write_text("to be or not to be, that is the question\n" * 40)
        specs = [("char_lm", {"input": str(tmp_path / "c.txt"), "block_size": 8})]
    else:
        specs = [(s["provider"], s["args"]) for s in _sources(tmp_path, kind)]
    for i, (name, args) in enumerate(specs):
        ctx = ProviderContext(f"p{i}", tmp_path / f"p{i}", batch_size=B, batches_per_file=NB)
        provider = create(name, ctx, args)
        provider.set_meta(provider.complete_meta())
        for seq in (0, 3):
            data = provider.make_file("train", seq).data
            want = batchfile_v3.arrays(data, batchfile_v3.parse(data, "f", FORMAT_VERSION))
            got = provider.stored_tensors("train", seq)
            assert got is not None and sorted(got) == sorted(want)
            for key, value in want.items():
                assert got[key].dtype == value.dtype and np.array_equal(got[key], value), key
