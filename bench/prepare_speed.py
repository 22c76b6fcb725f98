"""queue-prepare's tokens per second against its raw encoder on the same corpus, per core.

    .venv/bin/python -m bench.prepare_speed                                  # synthetic, 8 MB
    .venv/bin/python -m bench.prepare_speed --input corpus.txt --separator "" --copies 8

RAYON_NUM_THREADS is 1 for every case (set here before `tokenizers` starts its pool), so a
worker is one core. Cases, for a byte-level BPE trained here on the corpus (`hf`, vocab
--vocab-size) and a tiktoken ranks file written from that very BPE (`tiktoken`, the same
ids), taking turns in each of --repeats rounds:
  raw         the encoder alone on the corpus's documents, 1024 a call: encode_batch_fast
              (add_special_tokens=False) / encode_to_numpy per document
  prepare 1   `prepare()` with --workers 1 (tokenizing in this process), start to manifest:
              hashing the inputs, reading, tokenizing, shards written and fsynced
  prepare 2   the same with 2 worker processes (spawned and started inside the timing)
Rates count tokenizer tokens (the EOS prepare adds per document is not counted), per second of
wall time and per CPU second (this process's and its ended children's user + system time:
what a case costs a core, whatever else the machine runs). Ratios are medians of per-round
ratios over raw, so both sides of each ran seconds apart. With --input,
--copies K writes the file K times (K files, read in order) so that a run lasts long enough
for the 2-worker start-up to matter little.
"""

from __future__ import annotations

import os

# Before tokenizers is imported anywhere. Heavier imports (the suite's harness, torch) wait
# inside the functions that need them: spawned workers import this module again.
os.environ["RAYON_NUM_THREADS"] = "1"

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from queue_providers.prepare import CorpusSpec, PrepareOptions, prepare
from queue_providers.text.files import discover
from queue_providers.text.plan import iter_corpus
from queue_providers.text.readers import ReadOptions
from queue_providers.tokenizer_training.train_bpe import train_bpe

BLOCK_DOCS = 1024
SHARD_TOKENS = 10_000_000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, help="a text corpus; default: a synthetic one")
    ap.add_argument("--separator", default=None, help='with --input ("" = blank lines)')
    ap.add_argument("--copies", type=int, default=1, help="with --input: write it K times")
    ap.add_argument("--mb", type=float, default=8, help="synthetic corpus size")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizers", default="hf,tiktoken")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    return ap.parse_args(argv)


def make_corpus(args: argparse.Namespace, work: Path) -> tuple[Path, str | None]:
    folder = work / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    if args.input is None:
        from bench.bench_text_lm import synthetic_corpus

        synthetic_corpus(folder / "synthetic.txt", args.mb)
        return folder, ""
    data = args.input.read_bytes()
    for k in range(args.copies):
        (folder / f"copy-{k:03d}.txt").write_bytes(data)
    return folder, args.separator


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the pool's workers,
    joined when prepare() returns): on a shared machine, the cost that load does not blur."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def raw_rate(kind: str, encoder: Any, docs: list[str]) -> tuple[float, float]:
    began, cpu, n = time.perf_counter(), cpu_seconds(), 0
    for i in range(0, len(docs), BLOCK_DOCS):
        block = docs[i : i + BLOCK_DOCS]
        if kind == "hf":
            n += sum(len(e.ids) for e in encoder.encode_batch_fast(block, add_special_tokens=False))
        else:
            n += sum(len(encoder.encode_to_numpy(d, disallowed_special=())) for d in block)
    return n / (time.perf_counter() - began), n / (cpu_seconds() - cpu)


def prepare_rate(
    corpus: Path, separator: str | None, tokenizer: str, out: Path, workers: int
) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    spec = CorpusSpec(
        sources=(str(corpus),), hf_dataset=None, hf_split="train", hf_config=None,
        hf_revision=None, format="auto", separator=separator, text_key="text",
        utf8_errors="replace", max_document_bytes=64 << 20, cache_dir=out,
    )  # fmt: skip
    opts = PrepareOptions(
        corpus=spec, tokenizer=tokenizer, out=out, shard_tokens=SHARD_TOKENS, workers=workers
    )
    began, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepare(opts).manifest
    seconds, cpu = time.perf_counter() - began, cpu_seconds() - cpu
    tokens = manifest["total_tokens"] - manifest["total_documents"]
    return tokens / seconds, tokens / cpu


def encoders(kinds: list[str], bpe: Path, work: Path) -> dict[str, tuple[str, Any]]:
    """Per kind: the --tokenizer value prepare gets, and the raw encoder."""
    found: dict[str, tuple[str, Any]] = {}
    if "hf" in kinds:
        from tokenizers import Tokenizer

        found["hf"] = (str(bpe), Tokenizer.from_file(str(bpe)))
    if "tiktoken" in kinds:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str

        from bench.tokenizer_speed import write_ranks_from_bpe

        ranks, eos = write_ranks_from_bpe(bpe, work / "bpe.tiktoken")
        mergeable = load_tiktoken_bpe(str(ranks))
        enc = tiktoken.Encoding(
            "bpe", pat_str=r50k_pat_str, mergeable_ranks=mergeable,
            special_tokens={eos: len(mergeable)},
        )  # fmt: skip
        found["tiktoken"] = (f"tiktoken:{ranks}", enc)
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    corpus, separator = make_corpus(args, work)
    began = time.perf_counter()
    bpe = train_bpe(
        [str(corpus)], work / "bpe" / "tokenizer.json", vocab_size=args.vocab_size,
        separator=separator,
    )  # fmt: skip
    train_s = time.perf_counter() - began
    opts = ReadOptions(separator=separator)
    docs = [
        text
        for _, _, text in iter_corpus(
            discover(str(corpus), one_doc_per_file=separator is None), opts
        )
    ]
    kinds = args.tokenizers.split(",")
    found = encoders(kinds, bpe, work)
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for kind, (value, encoder) in found.items():
            got = {
                f"raw {kind}": raw_rate(kind, encoder, docs),
                f"prepare {kind} 1": prepare_rate(corpus, separator, value, work / "out", 1),
                f"prepare {kind} 2": prepare_rate(corpus, separator, value, work / "out", 2),
            }
            raw_wall, raw_cpu = got[f"raw {kind}"]
            for case, (wall, cpu) in got.items():
                rates.setdefault(case, []).append(wall)
                rates.setdefault(f"{case} per CPU s", []).append(cpu)
                if not case.startswith("raw"):
                    ratios.setdefault(f"{case} / raw", []).append(wall / raw_wall)
                    ratios.setdefault(f"{case} / raw per CPU s", []).append(cpu / raw_cpu)
    size = sum(p.stat().st_size for p in corpus.iterdir())
    print(
        f"corpus {size / 2**20:.1f} MB, {len(docs):,} documents; BPE vocab {args.vocab_size} "
        f"trained in {train_s:.1f} s; RAYON_NUM_THREADS=1; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'case':<34} {'M tokens/s (median)':>20}  runs")
    for case, got in rates.items():
        runs = ", ".join(f"{r / 1e6:.2f}" for r in got)
        print(f"{case:<34} {statistics.median(got) / 1e6:>20.3f}  {runs}")
    for case, got in ratios.items():
        runs = ", ".join(f"{r:.2f}" for r in got)
        print(f"{case:<34} {statistics.median(got):>19.2f}x  {runs}")
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "ratios": ratios, "documents": len(docs)}))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
