"""verify_diversity --near-duplicates on real batch files (text_lm's produce_file, as a
server's worker writes them): documents that differ by a few words are reported as pairs with
their similarity and places, across splits too; unrelated documents are not; without
datasketch the error names the extra to install."""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

import numpy as np
import pytest

from queue_client.format.batchfile import queue_dir
from queue_client.format.meta import dump_meta
from queue_providers import ProviderContext, create
from queue_providers.verify.near_duplicates import NearDuplicates, Place, shingle_hashes
from queue_providers.verify.verify_diversity import main

EVAL_TAKE = 20


def corpus(n: int = 80, seed: int = 5) -> list[str]:
    """Unrelated documents of ~60 words, each word made of random letters."""
    rnd = random.Random(seed)
    vocab = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(3, 8))) for _ in range(3000)]
    return [f"D{i:03d} " + " ".join(rnd.choices(vocab, k=60)) for i in range(n)]


def edit_words(doc: str, positions: list[int], seed: int) -> str:
    rnd = random.Random(seed)
    words = doc.split(" ")
    for p in positions:
        words[p] = "".join(rnd.choices(string.ascii_lowercase, k=len(words[p])))
    return " ".join(words)


def write_data_dir(root: Path, docs: list[str]) -> None:
    """meta.pkl and each split's files, made by text_lm with bin packing (whole documents)."""
    root.mkdir(parents=True)
    src = root / "corpus.txt"
    src.write_text("\n\n".join(docs) + "\n")
    ctx = ProviderContext("web", root / "web", batch_size=2, batches_per_file=3)
    args = {
        "source": str(src),
        "separator": "",
        "seq_len": 512,
        "micro_batch_size": 2,
        "eval_take": EVAL_TAKE,
        "packing": "bin",
        "shuffle": False,
    }
    p = create("text_lm", ctx, args)
    meta = p.complete_meta()
    p.set_meta(meta)
    for split, files in (("train", 8), ("val", 2)):
        qdir = queue_dir(root, "web", split)
        qdir.mkdir(parents=True, exist_ok=True)
        for seq in range(files):
            p.produce_file(split, seq, qdir)
    dump_meta(root / "web" / "meta.pkl", meta)


def verify(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    # More than one epoch of train is read: its windows repeat, which is not judged here.
    args = ["--data-dir", str(root), "--dataset", "web", "--max-duplicate-rate", "1"]
    code = main([*args, "--near-duplicates", *extra])
    return code, capsys.readouterr().out


def test_documents_that_differ_by_a_few_words_are_paired_and_unrelated_ones_are_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = corpus()
    # Two near-duplicates: val document 3 again in train with two words changed, and train
    # document 40 again in train with three words changed.
    leak = edit_words(docs[3], [10, 30], seed=1)
    twin = edit_words(docs[40], [5, 25, 45], seed=2)
    write_data_dir(tmp_path / "near", [*docs, leak, twin])
    code, out = verify(tmp_path / "near", capsys, "--json", "--world-size", "2")
    assert code == 0  # reported, not judged, unless a maximum is given
    near = json.loads(out)["near_duplicates"]
    assert near["pairs"] == 2 and near["pairs_across_splits"] == 1
    planted = {len(d.encode()) + 1 for d in (docs[3], leak, docs[40], twin)}  # + EOS
    for pair in near["shown"]:
        assert 0.8 <= pair["similarity"] < 1.0
        assert {pair["a"]["tokens"], pair["b"]["tokens"]} <= planted
        assert {"split", "seq", "batch", "row", "rank"} <= set(pair["a"]["at"])
    splits = sorted(
        tuple(sorted((p["a"]["at"]["split"], p["b"]["at"]["split"]))) for p in near["shown"]
    )
    assert splits == [("train", "train"), ("train", "val")]

    code, out = verify(tmp_path / "near", capsys, "--max-near-duplicate-pairs", "0")
    assert code == 1
    assert "near-duplicates (similarity >= 0.8, shingles of 5 tokens): 2 pairs" in out
    assert "1 across splits" in out and "near-duplicate pairs > 0" in out

    # The same corpus without the two edited copies: no pair at all.
    write_data_dir(tmp_path / "clean", docs)
    code, out = verify(tmp_path / "clean", capsys, "--json", "--max-near-duplicate-pairs", "0")
    assert code == 0 and json.loads(out)["near_duplicates"]["pairs"] == 0


def test_similarity_estimates_and_exact_repeats() -> None:
    rnd = np.random.default_rng(0)
    base = rnd.integers(0, 50_000, size=400)
    near = base.copy()
    near[[50, 150, 250]] = 7  # three tokens changed: about 15 of 396 shingles differ
    other = rnd.integers(0, 50_000, size=400)
    finder = NearDuplicates(threshold=0.8)
    finder.add(base, b"a", Place("train", 0, 0, 0))
    finder.add(base, b"a", Place("val", 1, 0, 0))  # the very same document read again
    finder.add(near, b"b", Place("train", 2, 0, 1))
    finder.add(other, b"c", Place("train", 3, 0, 0))
    pairs = finder.pairs()
    assert [(a, b) for _, a, b in pairs] == [(b"a", b"b")]
    true = len(np.intersect1d(shingle_hashes(base, 5), shingle_hashes(near, 5))) / len(
        np.union1d(shingle_hashes(base, 5), shingle_hashes(near, 5))
    )
    assert abs(pairs[0][0] - true) < 0.1
    report = finder.report(world_size=2)
    assert report["documents"] == 3 and report["shown"][0]["a"]["times_read"] == 2
    assert report["pairs_across_splits"] == 1 and report["pairs_across_ranks"] == 1


def test_without_datasketch_the_error_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasketch", None)  # as if it were not installed
    assert main(["--data-dir", str(tmp_path), "--dataset", "web", "--near-duplicates"]) == 2
    assert "pip install 'batchqueue[dedup]'" in capsys.readouterr().err
