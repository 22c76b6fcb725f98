"""The diversity verifier on a data dir: clean data passes with 0 duplicates and 0 overlap;
a train/val leak and repeated windows fail it with exit code 1."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from queue_client.format.batchfile import load_batch_file, queue_dir, write_batch_file
from queue_client.format.meta import dump_meta
from queue_providers import ProviderContext, create
from queue_providers.verify.verify_diversity import DiversityCheck, main

WORDS = "north south east west river stone cloud field lantern harbor meadow ridge".split()


def build_data_dir(
    root: Path,
    docs: list[str],
    *,
    packing: str,
    eval_take: int = 40,
    workers: int = 2,
    files: int = 4,
) -> None:
    """What the server would leave in a data dir: meta.pkl and each split's queued files."""
    src = root / "corpus.txt"
    src.write_text("\n\n".join(docs) + "\n")
    meta = None
    for split in ("train", "val"):
        for w in range(workers):
            ctx = ProviderContext(
                "web",
                root / "web",
                batch_size=2,
                batches_per_file=3,
                worker_index=w,
                num_workers=workers,
            )
            args = {
                "source": str(src),
                "separator": "",
                "seq_len": 256,
                "micro_batch_size": 2,
                "eval_take": eval_take,
                "packing": packing,
            }
            p = create("text_lm", ctx, args)
            meta = meta or p.complete_meta()
            p.set_meta(meta)
            qdir = queue_dir(root, "web", split)
            qdir.mkdir(parents=True, exist_ok=True)
            for i in range(files):
                p.produce_file(split, w + workers * i, qdir)
    dump_meta(root / "web" / "meta.pkl", meta)


def corpus(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [f"item {i}: " + " ".join(rnd.choices(WORDS, k=rnd.randint(8, 30))) for i in range(n)]


def test_clean_data_passes_with_zero_duplicates_and_overlap(tmp_path: Path, capsys) -> None:
    for packing in ("sequential", "bin"):
        root = tmp_path / packing
        root.mkdir()
        build_data_dir(root, corpus(300), packing=packing, eval_take=100, files=2)  # < 1 epoch
        argv = ["--data-dir", str(root), "--dataset", "web", "--json", "--judge-val-duplicates"]
        assert main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["overlap_documents"] == 0 and report["compared"]
        for split in ("train", "val"):
            s = report["splits"][split]
            assert s["batches"] > 0 and s["duplicate_windows"] == 0 and s["documents"] > 0
        if packing == "sequential":
            assert report["splits"]["train"]["padding_share"] == 0.0


def test_a_train_val_leak_fails(tmp_path: Path, capsys) -> None:
    docs = corpus(120)
    docs += docs[:40]  # the val documents again, later in the corpus: they land in train
    build_data_dir(tmp_path, docs, packing="bin", files=10)
    assert main(["--data-dir", str(tmp_path), "--dataset", "web", "--batches", "100"]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL" in out and "train/val overlap" in out


def test_repeated_windows_fail(tmp_path: Path, capsys) -> None:
    build_data_dir(tmp_path, corpus(200), packing="sequential", files=1)
    qdir = queue_dir(tmp_path, "web", "train")
    first = sorted(qdir.iterdir())[0]
    loaded = load_batch_file(first)  # the same batches twice, stored the same way
    write_batch_file(qdir, seq=1000, tensors=loaded.stored, metadata=loaded.metadata)
    assert main(["--data-dir", str(tmp_path), "--dataset", "web", "--splits", "train"]) == 1
    assert "duplicate-window rate" in capsys.readouterr().out


def test_missing_dataset_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["--data-dir", str(tmp_path), "--dataset", "nope"]) == 2
    assert "meta.pkl" in capsys.readouterr().err


def test_which_segments_count_as_documents() -> None:
    """A segment is hashed when it ends a document (last label -100); in sequential packing
    not when it starts the window, where it may be the tail of a longer document."""
    batch = {
        "input_ids": torch.tensor([[5, 6, 9, 7, 8, 9, 4]], dtype=torch.int32),  # 9 is EOS
        "labels": torch.tensor([[6, 9, -100, 8, 9, -100, 3]], dtype=torch.int32),
        "segment_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 3]], dtype=torch.int32),
        "attention_mask": torch.ones(1, 7, dtype=torch.bool),
    }
    for packing, want in (("sequential", 1), ("bin", 2)):
        check = DiversityCheck(packing=packing, min_doc_tokens=1)
        check.add("train", batch)
        assert check.splits["train"].summary()["documents"] == want
