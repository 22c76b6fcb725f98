"""queue-prepare as a user runs it: real processes over a corpus written here, read back and
checked against a direct encode of every document (ids, EOS after each, document offsets),
the same bytes for 1 and 2 worker processes, a SIGKILL midway resumed to the same shards, and
a changed input or tokenizer refused, naming what changed."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import process_gone, process_tree, subprocess_env
from queue_providers.prepare.layout import MANIFEST_FILE, PROGRESS_FILE
from queue_providers.tokenizer_training.train_bpe import train_bpe

WORDS = (
    "the queue serves batches while the trainer learns from every token of a corpus "
    "prepared once café naïve 東京 données shard window epoch"
).split()
EOS = "<|endoftext|>"
SHARD_TOKENS = 16384
DEADLINE_S = 120.0


def make_docs(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [
            " ".join(rnd.choices(WORDS, k=rnd.randint(3, 40))) for _ in range(rnd.randint(1, 4))
        ]
        docs.append(f"doc {i}: " + "\n".join(lines))
    return docs


def write_corpus(folder: Path, docs: list[str]) -> Path:
    """Two blank-line separated text files and a JSONL file: canonical order is 00, 01, 02."""
    folder.mkdir(parents=True, exist_ok=True)
    third = len(docs) // 3
    (folder / "00.txt").write_text("\n\n".join(docs[:third]) + "\n", encoding="utf-8")
    (folder / "01.txt").write_text("\n\n".join(docs[third : 2 * third]) + "\n", encoding="utf-8")
    rows = "".join(json.dumps({"text": d}) + "\n" for d in docs[2 * third :])
    (folder / "02.jsonl").write_text(rows, encoding="utf-8")
    return folder


def write_ranks(path: Path, merges: list[bytes]) -> Path:
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def prepare_cmd(corpus: Path, out: Path, tokenizer: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "queue_providers.prepare", "--input", str(corpus),
        "--separator", "", "--tokenizer", tokenizer, "--out", str(out),
        "--shard-tokens", str(SHARD_TOKENS), *extra,
    ]  # fmt: skip


def run_prepare(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, env=subprocess_env(), capture_output=True, text=True, timeout=DEADLINE_S * 3
    )
    if ok and proc.returncode != 0:
        raise AssertionError(f"queue-prepare failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def recorded_shards(out: Path) -> int:
    """How many shards the progress record of a running prepare lists (0 before it exists)."""
    try:
        return len(json.loads((out / PROGRESS_FILE).read_text())["shards"])
    except FileNotFoundError:
        return 0


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def read_back(out: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The manifest, every shard's tokens in one stream, and every document's start in it;
    checks each shard's dtype, length and continues_document flag on the way."""
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["format"] == "batchqueue-token-shards" and manifest["version"] == 1
    streams, starts, at = [], [], 0
    for i, shard in enumerate(manifest["shards"]):
        tokens = np.load(out / shard["file"], allow_pickle=False)
        docs = np.load(out / shard["file"].replace(".npy", ".docs.npy"), allow_pickle=False)
        assert tokens.dtype == np.dtype(manifest["dtype"]) and tokens.ndim == 1
        assert docs.dtype == np.int64 and len(docs) == shard["documents"]
        assert len(tokens) == shard["tokens"]
        if i < len(manifest["shards"]) - 1:
            assert len(tokens) == manifest["shard_tokens"]
        assert shard["continues_document"] == (len(docs) == 0 or docs[0] != 0)
        streams.append(tokens)
        starts.append(docs + at)
        at += len(tokens)
    return manifest, np.concatenate(streams), np.concatenate(starts)


def check_against(out: Path, docs: list[str], encode: Any, eos_id: int) -> dict[str, Any]:
    """The shards hold exactly each document's direct encoding followed by EOS, in order,
    and the offsets say where each document starts."""
    manifest, stream, starts = read_back(out)
    expected = [np.array([*encode(d), eos_id]) for d in docs]
    lengths = np.array([len(e) for e in expected])
    assert manifest["eos_id"] == eos_id and manifest["total_documents"] == len(docs)
    np.testing.assert_array_equal(starts, np.cumsum(lengths) - lengths)
    np.testing.assert_array_equal(stream, np.concatenate(expected))
    assert (stream[np.cumsum(lengths) - 1] == eos_id).all()
    assert (stream == eos_id).sum() == len(docs)  # EOS only where a document ends
    return manifest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], Path]:
    """About 2 MB of text in three files, and a byte-level BPE trained on it."""
    root = tmp_path_factory.mktemp("prepare")
    docs = make_docs(10000, seed=7)
    folder = write_corpus(root / "corpus", docs)
    bpe = train_bpe(
        [str(folder / "00.txt")], root / "bpe" / "tokenizer.json", vocab_size=400, separator=""
    )
    return folder, docs, bpe


@pytest.fixture(scope="module")
def reference(
    corpus: tuple[Path, list[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """An uninterrupted 1-worker run with the BPE: what every other run must equal."""
    folder, _, bpe = corpus
    out = tmp_path_factory.mktemp("reference") / "shards"
    run_prepare(prepare_cmd(folder, out, str(bpe), "--workers", "1"))
    return out


def test_a_trained_bpe_gives_each_document_then_eos_and_2_workers_the_same_bytes(
    corpus: tuple[Path, list[str], Path], reference: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    folder, docs, bpe = corpus
    tok = Tokenizer.from_file(str(bpe))
    manifest = check_against(
        reference,
        docs,
        lambda d: tok.encode(d, add_special_tokens=False).ids,
        tok.token_to_id(EOS),
    )
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == tok.get_vocab_size()
    assert manifest["tokenizer"]["kind"] == "hf" and len(manifest["shards"]) > 5
    assert any(s["continues_document"] for s in manifest["shards"])
    assert not (reference / PROGRESS_FILE).exists()

    two = tmp_path / "two"
    run_prepare(prepare_cmd(folder, two, str(bpe), "--workers", "2"))
    assert files_of(two) == files_of(reference)


def test_a_run_killed_midway_resumes_to_the_same_shards(
    corpus: tuple[Path, list[str], Path], reference: Path, tmp_path: Path
) -> None:
    folder, _, bpe = corpus
    out = tmp_path / "killed"
    cmd = prepare_cmd(folder, out, str(bpe), "--workers", "2")
    proc = subprocess.Popen(cmd, env=subprocess_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE_S
        # Killed once the first shard is written and recorded, so the next run must go on
        # from a resume point inside the corpus, not start over.
        while not (out / "shard-000000.npy").exists() or not recorded_shards(out):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no shard was written in time"
            time.sleep(0.005)
        tree = process_tree(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    # The pool's workers notice their parent is gone and end too.
    deadline = time.monotonic() + DEADLINE_S
    while not all(process_gone(pid) for pid in tree):
        assert time.monotonic() < deadline, "the worker processes outlived the killed run"
        time.sleep(0.05)
    assert not (out / MANIFEST_FILE).exists(), "the run finished before it was killed"
    kept = recorded_shards(out)
    assert (out / "shard-000000.npy").exists() and kept >= 1

    again = run_prepare(cmd)
    assert f"{kept} shard(s) kept from an earlier run" in again.stdout
    assert files_of(out) == files_of(reference)


def test_tiktoken_ranks_file_gives_each_document_then_eos(
    corpus: tuple[Path, list[str], Path], tmp_path: Path
) -> None:
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    docs = corpus[1][:1500]  # about 1 token a byte with so few merges: a smaller corpus
    folder = write_corpus(tmp_path / "corpus", docs)
    merges = [b"th", b"he", b"the", b" the", b"qu", b"ue", b"queue", b"er", b"in", b"an"]
    ranks = write_ranks(tmp_path / "small.tiktoken", merges)
    out = tmp_path / "tiktoken"
    run_prepare(prepare_cmd(folder, out, f"tiktoken:{ranks}"))
    mergeable = {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    eos_id = len(mergeable)
    enc = tiktoken.Encoding(
        "small", pat_str=r50k_pat_str, mergeable_ranks=mergeable, special_tokens={EOS: eos_id}
    )
    manifest = check_against(out, docs, enc.encode_ordinary, eos_id)
    assert manifest["tokenizer"]["kind"] == "tiktoken" and manifest["vocab_size"] == eos_id + 1


def test_a_document_longer_than_a_shard_runs_on_through_the_next_shards(tmp_path: Path) -> None:
    from queue_providers.prepare import main

    docs = ["a" * 3000, "short", "é" * 1300]  # 3001, 6 and 2601 byte tokens with EOS
    corpus = tmp_path / "long.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ["--input", str(corpus), "--separator", "", "--out", str(out), "--no-progress"]
    assert main([*args, "--shard-tokens", "1024"]) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert [s["tokens"] for s in manifest["shards"]] == [1024] * 5 + [5608 - 5 * 1024]
    # Shard 1 is all inside the first document: no document starts there.
    assert manifest["shards"][1]["continues_document"] and manifest["shards"][1]["documents"] == 0
    check_against(out, docs, lambda d: list(d.encode()), 256)
