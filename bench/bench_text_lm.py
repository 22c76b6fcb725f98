"""Throughput of the text_lm provider per worker process, byte and hf side by side with raw
`tokenizers` on the same text, in one run:

    .venv/bin/python bench/bench_text_lm.py                      # synthetic corpus
    .venv/bin/python bench/bench_text_lm.py --input some.txt --separator ""
    .venv/bin/python bench/bench_text_lm.py --threads 2 --data-dir /dev/shm

Rows (tokens per second of one process; tokenizer tokens, EOS not counted):
  raw encode_batch_fast      the hf tokenizer alone, encode_batch_fast on the very texts of
                             each block the provider rows tokenize, timed just before them
  raw encode_batch           encode_batch on the same texts, 1024 per call
  text_lm hf|byte pipeline   read + tokenize + pack: sample_batch in a loop
  text_lm hf|byte end to end produce_file: the above + stack + write + fsync
  file write bound           write_batch_file alone on same-shaped tensors: the ceiling that
                             writing 13 bytes per token (4 fields) sets on this file system

How the provider rows are timed: text_lm tokenizes a block of documents at once and then
serves its windows, so a run cut at a token count would leave part of a tokenized block
unserved and understate the rate. The bench wraps the provider's tokenizer and times whole
blocks, from the start of one block's tokenization to the start of the next: that span holds
the block's reading, tokenizing, packing and (end to end) every file write of its windows. The
first block is left out as warm-up.

The ratio column: for hf, each block's raw twin (the same texts through a second, equally
fresh Tokenizer, encoded seconds before) against the block's span, median over all blocks;
load on a shared machine drifts, and pairing block by block keeps the drift out. The share
column is the part of the provider's block time spent inside its tokenizer (encode_batch_fast
and turning the ids into one numpy array). RAYON_NUM_THREADS (read by `tokenizers` when its
thread pool starts) is --threads for every row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.format.batchfile import write_batch_file
from queue_providers import ProviderContext, create
from queue_providers.tokenizer_training.train_bpe import corpus_texts, train_bpe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, help="a corpus file; default: a synthetic one")
    ap.add_argument(
        "--separator", default=None, help='with --input: separator line ("" = blank lines)'
    )
    ap.add_argument("--mb", type=float, default=32, help="synthetic corpus size for byte")
    ap.add_argument("--hf-mb", type=float, default=4, help="synthetic corpus size for hf")
    ap.add_argument("--threads", type=int, default=1, help="tokenizers threads (RAYON_NUM_THREADS)")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json; default: train a BPE here")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--batches-per-file", type=int, default=8)
    ap.add_argument("--block-docs", type=int, default=1024, help="text_lm shuffle_buffer")
    ap.add_argument("--hf-blocks", type=int, default=4, help="blocks timed per hf run")
    ap.add_argument("--byte-blocks", type=int, default=12, help="blocks timed per byte run")
    ap.add_argument("--repeat", type=int, default=5, help="rounds")
    ap.add_argument(
        "--data-dir", type=Path, default=None, help="where batch files go (default: temp)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args(argv)


ARGS = argparse.Namespace()  # set by main(), so importing this module parses nothing


def synthetic_corpus(path: Path, megabytes: float, seed: int = 0) -> None:
    """Documents of 100-700 words drawn Zipf-like from 20k pseudo-words, blank-line separated."""
    rnd = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(letters[rnd.integers(0, 26, size=rnd.integers(2, 10))]) for _ in range(20_000)]
    p = 1.0 / np.arange(1, len(vocab) + 1)
    words = rnd.choice(len(vocab), size=int(megabytes * 2**20 / 6.5), p=p / p.sum())
    docs, i = [], 0
    while i < len(words):
        n = int(rnd.integers(100, 700))
        docs.append(" ".join(vocab[w] for w in words[i : i + n]))
        i += n
    path.write_text("\n\n".join(docs) + "\n")


class BlockClock:
    """Stands in for the provider's tokenizer: notes when each block's tokenization starts, how
    long it takes and how many tokens (EOS excluded) it makes. Given `raw`, a fresh
    `tokenizers.Tokenizer` of the same file, it first encodes the very same texts with raw
    encode_batch_fast, so each provider block has a raw twin timed seconds apart."""

    def __init__(self, tok: Any, raw: Any = None) -> None:
        self.tok, self.raw = tok, raw
        self.starts: list[float] = []
        self.busy: list[float] = []
        self.tokens: list[int] = []
        self.raw_s: list[float] = []

    def encode_docs(self, texts):
        if self.raw is not None:
            t = time.perf_counter()
            self.raw.encode_batch_fast(texts, add_special_tokens=False)
            self.raw_s.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        flat, lengths = self.tok.encode_docs(texts)
        self.busy.append(time.perf_counter() - t0)
        self.starts.append(t0)
        self.tokens.append(int(lengths.sum()) - len(lengths))
        return flat, lengths

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def spans(self) -> list[float]:
        """Each timed block's seconds: from its tokenization's start to the next block's, less
        the raw twin encoded in between. Block 0 (warm-up) and the last are left out."""
        twin = self.raw_s if self.raw is not None else [0.0] * len(self.starts)
        return [
            self.starts[k + 1] - self.starts[k] - twin[k + 1]
            for k in range(1, len(self.starts) - 1)
        ]

    def rate(self) -> float:
        return sum(self.tokens[1:-1]) / sum(self.spans())

    def share(self) -> float:
        return sum(self.busy[1:-1]) / sum(self.spans())

    def raw_rate(self) -> float:
        return sum(self.tokens[1:-1]) / sum(self.raw_s[1:-1])

    def ratios(self) -> list[float]:
        """Per block: provider rate / raw rate on the same texts = raw seconds / block seconds."""
        return [r / s for r, s in zip(self.raw_s[1:-1], self.spans(), strict=True)]


class Setup:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.a, self.b, self.t = ARGS.grad_accum, ARGS.micro_batch, ARGS.seq_len
        self.bpf = ARGS.batches_per_file
        self.runs = 0

    def provider(self, source: Path, separator: str | None, **args: Any):
        self.runs += 1
        ctx = ProviderContext(
            "bench", self.data_dir / f"ds{self.runs}", batch_size=self.a, batches_per_file=self.bpf
        )
        p = create(
            "text_lm",
            ctx,
            {
                "source": str(source),
                "separator": separator,
                "seq_len": self.t,
                "micro_batch_size": self.b,
                "eval_take": 0,
                "shuffle_buffer": ARGS.block_docs,
                **args,
            },
        )
        p.set_meta(p.complete_meta())  # one-time work, not timed
        p.tokenizer = BlockClock(p.tokenizer)  # the stream, made on first use, picks it up
        return p

    def pipeline(self, p, blocks: int) -> None:
        g = torch.Generator()
        while len(p.tokenizer.starts) < blocks + 2:
            p.sample_batch("train", g)

    def end_to_end(self, p, blocks: int) -> None:
        qdir = self.data_dir / f"q{self.runs}"
        qdir.mkdir(parents=True, exist_ok=True)
        seq = 0
        while len(p.tokenizer.starts) < blocks + 2:
            p.produce_file("train", seq, qdir)
            seq += 1

    def write_bound(self, files: int) -> float:
        shape = (self.bpf, self.a, self.b, self.t)
        tensors = {
            "input_ids": torch.randint(0, 1000, shape, dtype=torch.int32),
            "labels": torch.randint(0, 1000, shape, dtype=torch.int32),
            "attention_mask": torch.ones(shape, dtype=torch.bool),
            "segment_ids": torch.ones(shape, dtype=torch.int32),
        }
        qdir = self.data_dir / "write-bound"
        qdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for seq in range(files):
            write_batch_file(qdir, seq=seq, tensors=tensors, metadata={})
        rate = files * self.bpf * self.a * self.b * self.t / (time.perf_counter() - t0)
        shutil.rmtree(qdir)
        return rate


def raw_rate(tok: Any, texts: list[str], tokens: float, fast: bool) -> float:
    """Tokens per second of encoding `texts`, 1024 per call, cycling, `tokens` ids in all."""
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    done, i = 0, 0
    t0 = time.perf_counter()
    while done < tokens:
        batch = texts[i : i + ARGS.block_docs]
        i = i + ARGS.block_docs if i + ARGS.block_docs < len(texts) else 0
        done += sum(len(e) for e in encode(batch, add_special_tokens=False))
    return done / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ARGS = parse_args(argv)
    # tokenizers sizes its thread pool from this when the pool first starts, which is later.
    os.environ["RAYON_NUM_THREADS"] = str(ARGS.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from tokenizers import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-text-lm-"))
    data_dir = Path(tempfile.mkdtemp(prefix="bench-text-lm-", dir=ARGS.data_dir))
    try:
        if ARGS.input is not None:
            byte_src = hf_src = ARGS.input
            separator = ARGS.separator
            corpus = f"{ARGS.input.name} ({ARGS.input.stat().st_size / 1e6:.1f} MB)"
        else:
            byte_src, hf_src, separator = work / "byte.txt", work / "hf.txt", ""
            synthetic_corpus(byte_src, ARGS.mb)
            synthetic_corpus(hf_src, ARGS.hf_mb, seed=1)
            corpus = f"synthetic, {ARGS.mb:g} MB (byte) and {ARGS.hf_mb:g} MB (hf), documents of 100-700 words"
        texts = list(corpus_texts([str(hf_src)], separator=separator))
        if ARGS.tokenizer is None:
            t0 = time.perf_counter()
            tok_path = train_bpe(
                [str(hf_src)],
                work / "tokenizer.json",
                vocab_size=ARGS.vocab_size,
                separator=separator,
            )
            trained = f" (trained here in {time.perf_counter() - t0:.1f} s)"
        else:
            tok_path, trained = ARGS.tokenizer, ""
        tok = Tokenizer.from_file(str(tok_path))
        setup = Setup(data_dir)
        hf_tokens = 0.0
        rates: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        shares: dict[str, list[float]] = {}

        def record(name: str, rate: float, share: float | None = None) -> None:
            rates.setdefault(name, []).append(rate)
            if share is not None:
                shares.setdefault(name, []).append(share)

        for _ in range(ARGS.repeat):
            for name, run in (
                ("text_lm hf pipeline", setup.pipeline),
                ("text_lm hf end to end", setup.end_to_end),
            ):
                p = setup.provider(hf_src, separator, tokenizer="hf", tokenizer_path=str(tok_path))
                p.tokenizer.raw = Tokenizer.from_file(str(tok_path))  # as cold as the provider's
                run(p, ARGS.hf_blocks)
                clock = p.tokenizer
                record(name, clock.rate(), share=clock.share())
                ratios.setdefault(name, []).extend(clock.ratios())
                record("raw encode_batch_fast", clock.raw_rate())
                hf_tokens = sum(clock.tokens[1:-1])
            slow = raw_rate(tok, texts, hf_tokens, fast=False)
            record("raw encode_batch", slow)
            ratios.setdefault("raw encode_batch", []).append(
                slow / raw_rate(tok, texts, hf_tokens, fast=True)
            )
            for name, run in (
                ("text_lm byte pipeline", setup.pipeline),
                ("text_lm byte end to end", setup.end_to_end),
            ):
                p = setup.provider(byte_src, separator)
                run(p, ARGS.byte_blocks)
                record(name, p.tokenizer.rate())
            record("file write bound", setup.write_bound(files=16))
            for queue in data_dir.glob("q*"):  # this round's files, deleted outside any timing
                shutil.rmtree(queue)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    print(f"corpus: {corpus}; tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}{trained}")
    print(
        f"threads: {ARGS.threads}; batch [A, B, T] = [{setup.a}, {setup.b}, {setup.t}], {setup.bpf} "
        f"batches per file, {ARGS.block_docs} documents per block; data dir: "
        f"{ARGS.data_dir or 'system temp'}; medians of {ARGS.repeat} rounds"
    )
    print()
    print(
        "| what | M tokens/s | vs raw encode_batch_fast | tokenizer's share of its time | runs (M tokens/s) |"
    )
    print("|---|---:|---:|---:|---|")
    order = [
        "raw encode_batch_fast",
        "raw encode_batch",
        "text_lm hf pipeline",
        "text_lm hf end to end",
    ]
    order += ["text_lm byte pipeline", "text_lm byte end to end", "file write bound"]
    for name in order:
        ratio = f"{statistics.median(ratios[name]):.2f}x" if name in ratios else ""
        ratio = "1.00x" if name == "raw encode_batch_fast" else ratio
        share = f"{statistics.median(shares[name]):.2f}" if name in shares else ""
        runs = ", ".join(f"{v / 1e6:.2f}" for v in rates[name])
        print(
            f"| {name} | {statistics.median(rates[name]) / 1e6:.2f} | {ratio} | {share} | {runs} |"
        )
    if ARGS.json is not None:
        ARGS.json.write_text(
            json.dumps(
                {"rates": rates, "ratios": ratios, "shares": shares, "args": vars(ARGS)},
                default=str,
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
