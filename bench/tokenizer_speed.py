"""Row 12: text_lm's tokens per second with a tiktoken encoding against a Hugging Face BPE of the
same vocabulary, each beside its raw encoder on the same documents.

cl100k_base cannot be downloaded here, so both encoders are made from the suite's own text: a
byte-level BPE trained by `queue_providers.tokenizer_training.train_bpe` (the `hf` side), and a tiktoken ranks
file written from that very BPE (its tokens as bytes, its ids as ranks, GPT-2's split regex,
which is the one the byte-level pre-tokenizer uses): the same vocabulary, and the same ids on
the documents the row checks (the note gives the share that agree). text_lm reads the file by
its `.tiktoken` suffix, as a user's config would.

Each side is timed four ways, in interleaved repeats in one child process with
RAYON_NUM_THREADS=1 (so `tokenizers` and text_lm's tiktoken pool both run one thread, as a
worker does by default on a 1-core share, and no earlier row has sized the rayon pool):
  - raw: the encoder alone on the corpus's documents, 1024 a call (text_lm's block):
    `Tokenizer.encode_batch_fast(add_special_tokens=False)` / tiktoken's
    `Encoding.encode_to_numpy(disallowed_special=())` document by document (its fastest way
    to ids on one thread; tiktoken's `encode_ordinary_batch`, which makes Python lists in a
    thread pool started per call, is the row's last line);
  - text_lm: the provider's `sample_batch` in a loop (read, tokenize, pack; sequential
    packing, [A, B, T] = [1, 8, 1024], blocks of 1024 documents), one corpus epoch a repeat.
Rates count tokenizer tokens: text_lm's window positions less the one EOS per document it
adds (scaled by the corpus's tokens / (tokens + documents)). Ratios are medians of per-repeat
ratios, so the two sides of each ran seconds apart.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.data import Tokens
from bench.harness import Result, Settings, fmt
from bench.servers import Server, ServerSpec

REPO = Path(__file__).resolve().parent.parent
BLOCK_DOCS = 1024
A, B, T = 1, 8, 1024
# Each ratio the row reports: (its name, the case over, the case under).
PAIRS = (
    ("text_lm tiktoken / raw", "text_lm tiktoken", "raw tiktoken"),
    ("text_lm hf / raw", "text_lm hf", "raw hf"),
    ("raw tiktoken / raw hf", "raw tiktoken", "raw hf"),
    ("text_lm tiktoken / text_lm hf", "text_lm tiktoken", "text_lm hf"),
    ("raw tiktoken lists / raw", "raw tiktoken lists", "raw tiktoken"),
)


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # in a child process: no server


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    work = settings.workdir / "tokenizer_speed"
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "text": str(tokens.text_path),
        "work": str(work),
        "vocab_size": settings.pick(8192, 1024),
        "repeats": settings.repeats,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.tokenizer_speed", str(work / "spec.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the tokenizer_speed child failed:\n{proc.stderr[-3000:]}")
    got = json.loads((work / "result.json").read_text())
    return _results(got)


def _results(got: dict[str, Any]) -> list[Result]:
    med = {k: statistics.median(v) / 1e6 for k, v in got["rates"].items()}
    ratio = {k: statistics.median(v) for k, v in got["ratios"].items()}
    note = (
        f"vocab {got['vocab']} (BPE trained here in {got['train_s']:.1f} s; tiktoken ranks "
        f"written from it), {got['documents']:,} documents, {got['tokens']:,} tokens; "
        f"{got['agree']:.1%} of the documents get the same ids from both"
    )
    extra = {"rates": got["rates"], "ratios": got["ratios"]}
    return [
        Result(
            "12",
            "text_lm tiktoken (.tiktoken ranks), read+tokenize+pack, 1 thread",
            med["text_lm tiktoken"],
            "M tokens/s",
            "raw encode_to_numpy",
            med["raw tiktoken"],
            "M tokens/s",
            ratio["text_lm tiktoken / raw"],
            "x raw",
            "info",
            None,
            note,
            extra=extra,
        ),
        Result(
            "12",
            "text_lm hf (same BPE, tokenizer.json), read+tokenize+pack, 1 thread",
            med["text_lm hf"],
            "M tokens/s",
            "raw encode_batch_fast",
            med["raw hf"],
            "M tokens/s",
            ratio["text_lm hf / raw"],
            "x raw",
            "info",
        ),
        Result(
            "12",
            "raw tiktoken encode_to_numpy, same vocab",
            med["raw tiktoken"],
            "M tokens/s",
            "raw encode_batch_fast",
            med["raw hf"],
            "M tokens/s",
            ratio["raw tiktoken / raw hf"],
            "x faster",
            "info",
        ),
        Result(
            "12",
            "text_lm tiktoken vs text_lm hf, same vocab",
            med["text_lm tiktoken"],
            "M tokens/s",
            "text_lm hf",
            med["text_lm hf"],
            "M tokens/s",
            ratio["text_lm tiktoken / text_lm hf"],
            "x faster",
            "info",
        ),
        Result(
            "12",
            "raw tiktoken encode_ordinary_batch(num_threads=1): lists of ids",
            med["raw tiktoken lists"],
            "M tokens/s",
            "raw encode_to_numpy",
            med["raw tiktoken"],
            "M tokens/s",
            ratio["raw tiktoken lists / raw"],
            "x raw",
            "info",
        ),
    ]


# ---- the child process ------------------------------------------------------------------------


def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every other
    byte for the code point 256 + its index among them (the GPT-2 convention)."""
    visible = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {chr(b): b for b in visible}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + k): b for k, b in enumerate(others)})
    return table


def write_ranks_from_bpe(tokenizer_json: Path, out: Path) -> tuple[Path, str]:
    """A .tiktoken ranks file holding the BPE's tokens as bytes, ranked by their ids (merge
    order: the trainer numbers merges as it makes them); returns it and the BPE's EOS token."""
    from tokenizers import Tokenizer, pre_tokenizers

    byte_of = _byte_of_char()
    if set(byte_of) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the byte-level alphabet is not the one tokenizers uses")
    tok = Tokenizer.from_file(str(tokenizer_json))
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    lines = [
        base64.b64encode(bytes(byte_of[c] for c in token)) + b" %d\n" % rank
        for token, rank in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        if token not in specials
    ]
    out.write_bytes(b"".join(lines))
    return out, sorted(specials)[0]


def _raw_hf(tok: Any, docs: list[str]) -> tuple[int, float]:
    began, n = time.perf_counter(), 0
    for i in range(0, len(docs), BLOCK_DOCS):
        n += sum(
            len(e.ids)
            for e in tok.encode_batch_fast(docs[i : i + BLOCK_DOCS], add_special_tokens=False)
        )
    return n, time.perf_counter() - began


def _raw_tiktoken(enc: Any, docs: list[str]) -> tuple[int, float]:
    began, n = time.perf_counter(), 0
    for i in range(0, len(docs), BLOCK_DOCS):
        n += sum(
            len(enc.encode_to_numpy(d, disallowed_special=())) for d in docs[i : i + BLOCK_DOCS]
        )
    return n, time.perf_counter() - began


def _raw_tiktoken_lists(enc: Any, docs: list[str]) -> tuple[int, float]:
    began, n = time.perf_counter(), 0
    for i in range(0, len(docs), BLOCK_DOCS):
        n += sum(map(len, enc.encode_ordinary_batch(docs[i : i + BLOCK_DOCS], num_threads=1)))
    return n, time.perf_counter() - began


def _provider(work: Path, name: str, text: str, tokenizer: str) -> Any:
    from queue_providers import ProviderContext, create

    ctx = ProviderContext(name, work / "datasets" / name, batch_size=A, batches_per_file=1)
    p = create(
        "text_lm",
        ctx,
        {
            "source": text,
            "separator": "",
            "tokenizer": tokenizer,
            "seq_len": T,
            "micro_batch_size": B,
            "eval_take": 0,
            "shuffle_buffer": BLOCK_DOCS,
        },
    )
    p.set_meta(p.complete_meta())
    return p


def _text_lm(p: Any, batches: int) -> tuple[int, float]:
    import torch

    g = torch.Generator()
    began = time.perf_counter()
    for _ in range(batches):
        p.sample_batch("train", g)
    return batches * A * B * T, time.perf_counter() - began


def child(spec_path: Path) -> None:
    import tiktoken
    import torch
    from tokenizers import Tokenizer

    from queue_providers.tokenizer_sources import gpt2_pattern, read_ranks
    from queue_providers.tokenizer_training.train_bpe import corpus_texts, train_bpe

    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    work, text = Path(spec["work"]), spec["text"]
    docs = list(corpus_texts([text], separator=""))
    began = time.perf_counter()
    tok_json = train_bpe(
        [text], work / "tokenizer.json", vocab_size=spec["vocab_size"], separator=""
    )
    train_s = time.perf_counter() - began
    ranks_path, eos = write_ranks_from_bpe(tok_json, work / "bpe.tiktoken")
    hf = Tokenizer.from_file(str(tok_json))
    ranks = read_ranks(ranks_path, who="bench")
    enc = tiktoken.Encoding(
        "bpe",
        pat_str=gpt2_pattern(),
        mergeable_ranks=ranks,
        special_tokens={eos: max(ranks.values()) + 1},
    )
    sample = docs[:2000]
    same = sum(
        e.ids == t
        for e, t in zip(
            hf.encode_batch_fast(sample, add_special_tokens=False),
            enc.encode_ordinary_batch(sample, num_threads=1),
            strict=True,
        )
    )
    tokens, _ = _raw_hf(hf, docs)
    # text_lm's windows hold one EOS per document besides the tokenizer's tokens.
    share = tokens / (tokens + len(docs))
    epoch = max(1, round((tokens + len(docs)) / (A * B * T)))
    sides = {
        "hf": _provider(work, "hf", text, str(tok_json)),
        "tiktoken": _provider(work, "tiktoken", text, str(ranks_path)),
    }
    for p in sides.values():
        _text_lm(p, 1)  # the first block: warm
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(spec["repeats"]):
        now: dict[str, float] = {}
        cases = [
            ("raw hf", lambda: _raw_hf(hf, docs)),
            ("raw tiktoken", lambda: _raw_tiktoken(enc, docs)),
            ("raw tiktoken lists", lambda: _raw_tiktoken_lists(enc, docs)),
            ("text_lm hf", lambda: _text_lm(sides["hf"], epoch)),
            ("text_lm tiktoken", lambda: _text_lm(sides["tiktoken"], epoch)),
        ]
        for name, timed in cases[r % len(cases) :] + cases[: r % len(cases)]:
            n, seconds = timed()
            now[name] = n * (share if name.startswith("text_lm") else 1.0) / seconds
            rates.setdefault(name, []).append(now[name])
        for key, a, b in PAIRS:
            ratios.setdefault(key, []).append(now[a] / now[b])
    result = {
        "rates": rates,
        "ratios": ratios,
        "vocab": hf.get_vocab_size(),
        "train_s": train_s,
        "documents": len(docs),
        "tokens": tokens,
        "agree": same / len(sample),
    }
    (work / "result.json").write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    """The child: `python -m bench.tokenizer_speed SPEC.json` writes result.json beside it;
    `python -m bench.tokenizer_speed` alone runs the row and prints its lines."""
    if argv:
        child(Path(argv[0]))
        return 0
    import tempfile

    from bench.data import prepare

    with tempfile.TemporaryDirectory(prefix="bq-tokspeed-") as tmp:
        settings = Settings(quick=False, text=None, workdir=Path(tmp), repeats=5)
        tokens = prepare(None, Path(tmp) / "tokens", quick=False)
        for r in run(settings, tokens, {}):
            print(
                f"{r.case}: {fmt(r.value)} {r.unit}; {r.ref_name} {fmt(r.ref_value)} {r.ref_unit}; "
                f"{fmt(r.ratio)}{r.ratio_label}"
            )
            if r.note:
                print(f"  note: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
