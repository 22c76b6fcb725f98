"""Row 10: each built-in provider's tokens per second per worker process, beside its file floor.

A worker's whole job is `make_file`: sample batches_per_file batches, stack them, encode the
file (format 3: a JSON header and the raw tensor bytes, + crc32). This row calls it in-process, at torch's 1 thread as a worker runs,
for consecutive seqs on corpora made from the suite's text. Beside each provider, in the same
interleaved repeats, the floor any provider pays for that very file: its tensors, unbound into
batches, stacked and encoded again with no sampling at all (two copies of the bytes and a
crc32, i.e. the memcpy limit of a batch file). The ratio is the provider's rate over the
floor's: 1.0 would mean sampling costs nothing. text_lm's rows also time its tokenizer alone on
the corpus (the note), since tokenizing is part of its work and of no other provider's.

Beside each provider, in the same repeats, its twin on a meta from before format 2, which writes
format 1 files (every field in its served dtype, as all providers did before): the note gives
its rate and the ratio, the cost or gain of the compact encoding (narrower bytes to write,
against the check that every field reads back). Tokens are token positions of the input field, padding included: B*T per batch ([A, B, T] for
text_lm).

The second half of the row is the bytes on disk per token of each provider's batch files
(format 2 and later: narrow ids, one window for x and y, no derivable fields) beside the same batches in
format 1 (every field in its served dtype), the whole file counted (torch.save's zip and the
metadata included; format 1 is a torch.save zip). The goal, 2.1 bytes per token, is for the LM providers whose x and y are
token windows, with vocabularies up to 65,536; the others carry a second id field (labels). The corpora are the suite's text as it is (char_lm, char_diffusion, nanogpt_bin,
text_lm, bert_mlm) and, for the labelled providers, its lines as examples (classification) or
sentences (token_classification) with labels derived from the words, under a word-level vocab.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.data import Tokens
from bench.harness import Result, Settings, fmt, median
from bench.servers import Server, ServerSpec

SEED = 1337
BYTES_GOAL = 2.1
# Providers whose x/y are token windows: one uint16 window of T+1 ids per row on disk.
WINDOW_PROVIDERS = ("char_lm", "nanogpt_bin", "text_lm")
LM_B, LM_T = 12, 1024
TOK_B, TOK_T = 32, 128
LABELS = ("a", "b", "c", "d")
TAGS = ("B-X", "I-X", "O")


@dataclass(frozen=True)
class Case:
    """One provider as the row runs it: config args and the shape of its input field."""

    name: str
    provider: str
    args: dict[str, Any]
    batch_size: int
    tokens_per_batch: int


def servers(settings: Settings, tokens: Tokens) -> list[ServerSpec]:
    return []  # in-process: no server


def batches_per_file(settings: Settings) -> int:
    return settings.pick(50, 2)


def cases(tokens: Tokens, corpus: Path) -> list[Case]:
    """The providers, on corpora written under `corpus` from the suite's text."""
    text = tokens.text_path
    corpus.mkdir(parents=True, exist_ok=True)
    vocab = _write_vocab(text, corpus / "vocab.txt")
    lm = {"block_size": LM_T, "input": str(text)}
    text_lm = {
        "source": str(text),
        "separator": "",
        "tokenizer": "byte",
        "seq_len": LM_T,
        "micro_batch_size": LM_B // 2,
        "eval_take": 10,
    }
    tok = {"tokenizer": str(vocab), "block_size": TOK_T}
    lm_tokens, tok_tokens = LM_B * LM_T, TOK_B * TOK_T
    return [
        Case("char_lm", "char_lm", lm, LM_B, lm_tokens),
        Case(
            "nanogpt_bin",
            "nanogpt_bin",
            {
                "data_dir": str(tokens.train_bin.parent),
                "block_size": LM_T,
                "vocab_size": tokens.vocab_size,
                "splits": ["train"],
            },
            LM_B,
            lm_tokens,
        ),
        Case("char_diffusion", "char_diffusion", lm, LM_B, lm_tokens),
        Case("text_lm byte, sequential", "text_lm", text_lm, 2, lm_tokens),
        Case("text_lm byte, bin", "text_lm", {**text_lm, "packing": "bin"}, 2, lm_tokens),
        Case("bert_mlm", "bert_mlm", {"input": str(text), **tok}, TOK_B, tok_tokens),
        Case(
            "classification",
            "classification",
            {"input": str(_write_examples(text, corpus / "examples.jsonl")), **tok},
            TOK_B,
            tok_tokens,
        ),
        Case(
            "token_classification",
            "token_classification",
            {"input": str(_write_conll(text, corpus / "tagged.conll")), **tok},
            TOK_B,
            tok_tokens,
        ),
    ]


def run(settings: Settings, tokens: Tokens, found: dict[str, Server]) -> list[Result]:
    from queue_providers.text.tokenizer import ByteTokenizer

    nb = batches_per_file(settings)
    files = settings.pick(2, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a worker process
    try:
        root = settings.workdir / "providers"
        started = {case.name: _start(case, root, nb) for case in cases(tokens, root)}
        made = {name: (case, provider) for name, (case, provider, _) in started.items()}
        rates: dict[str, list[float]] = {name: [] for name in made}
        rates_v1: dict[str, list[float]] = {name: [] for name in made}
        floors: dict[str, list[float]] = {name: [] for name in made}
        seq = 1  # seq 0 was the warm-up
        for r in range(settings.repeats):
            names = list(made)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                case, provider, twin = started[name]
                per_file = nb * case.tokens_per_batch
                pair = [(provider, rates[name]), (twin, rates_v1[name])]
                for who, into in pair if r % 2 == 0 else pair[::-1]:
                    began = time.perf_counter()
                    encoded = [who.make_file("train", seq + k) for k in range(files)]
                    into.append(files * per_file / (time.perf_counter() - began))
                    if who is provider:
                        floors[name].append(per_file / _floor_seconds(encoded[-1].data))
            seq += files
        raw_byte = _tokenizer_rate(ByteTokenizer().encode_docs, tokens.text_path)
    finally:
        torch.set_num_threads(threads)
    results = []
    sizes = {name: _bytes_per_token(case, provider, seq) for name, (case, provider) in made.items()}
    for name, (case, _) in made.items():
        value, floor, v1 = median(rates[name]), median(floors[name]), median(rates_v1[name])
        note = f"format 1 files (served dtypes): {fmt(v1 / 1e6)} M tokens/s, {value / v1:.2f}x"
        if case.provider == "text_lm":
            note += f"; its byte tokenizer alone: {fmt(raw_byte / 1e6)} M tokens/s on the same text"
        results.append(
            Result(
                "10",
                f"{name}, make_file, B*T={case.tokens_per_batch}, {nb} batches per file",
                value / 1e6,
                "M tokens/s",
                "the file's floor (stack + encode)",
                floor / 1e6,
                "M tokens/s",
                value / floor,
                "x floor",
                "info",
                None,
                note,
                extra={"rates": rates[name], "floors": floors[name], "format_1": rates_v1[name]},
            )
        )
    for name, (case, _) in made.items():
        now, before, stored = sizes[name]
        window = case.provider in WINDOW_PROVIDERS
        results.append(
            Result(
                "10",
                f"{name}, bytes on disk per token, {nb} batches per file",
                now,
                "B/token",
                "format 1 (served dtypes)",
                before,
                "B/token",
                before / now,
                "x smaller",
                f"<= {BYTES_GOAL:g}" if window else "info",
                now <= BYTES_GOAL if window else None,
                f"stores {stored}",
            )
        )
    return results


def _bytes_per_token(case: Case, provider: Any, seq: int) -> tuple[float, float, str]:
    """(bytes per token of a file as the provider writes it, of the same batches written in
    format 1, what the file stores)."""
    from queue_client.format.batchfile import encode_batch_file, load_batch_bytes
    from queue_client.format.schema import FieldSpec

    encoded = provider.make_file("train", seq)
    loaded = load_batch_bytes(encoded.data, case.name)
    schema = loaded.schema or ()
    plain = [FieldSpec(f.name, f.dtype, f.shape, f.role).to_dict() for f in schema]
    old = encode_batch_file(
        seq=seq,
        tensors=loaded.tensors,
        metadata={**loaded.metadata, "schema": plain},
        version=1,
    )
    tokens = encoded.num_batches * case.tokens_per_batch
    stored = ", ".join(
        f"{k} {str(v.dtype).removeprefix('torch.')}{list(v.shape[1:])}"
        for k, v in loaded.stored.items()
    )
    return len(encoded.data) / tokens, len(old.data) / tokens, stored


def _start(case: Case, root: Path, nb: int) -> tuple[Case, Any, Any]:
    """The provider built, its meta settled, and one file made (caches and pages warm); and
    its twin on a meta from before format 2, which writes format 1 files."""
    from queue_providers import ProviderContext, create

    name = re.sub(r"\W+", "_", case.name)
    ctx = ProviderContext(
        name,
        root / "datasets" / name,
        batch_size=case.batch_size,
        batches_per_file=nb,
        seed=SEED,
    )
    provider = create(case.provider, ctx, dict(case.args))
    meta = provider.complete_meta()
    provider.set_meta(meta)
    provider.make_file("train", 0)
    twin = create(case.provider, ctx, dict(case.args))
    twin.set_meta(_format_1(meta))
    twin.make_file("train", 0)
    return case, provider, twin


def _format_1(meta: dict[str, Any]) -> dict[str, Any]:
    """meta as a dataset dir built before format 2 holds it: its files are written as served."""
    old = {k: v for k, v in meta.items() if k != "batch_format_version"}
    old["batch_schema"] = [
        {k: v for k, v in f.items() if k not in ("stored_dtype", "storage")}
        for f in meta["batch_schema"]
    ]
    return old


def _floor_seconds(data: bytes) -> float:
    """Seconds to stack and encode a file's tensors again: the bytes any provider must write."""
    from queue_client.format.batchfile import encode_batch_file, load_batch_bytes

    loaded = load_batch_bytes(data, "floor")
    batches = {k: list(v.unbind(0)) for k, v in loaded.stored.items()}
    began = time.perf_counter()
    tensors = {k: torch.stack(v) for k, v in batches.items()}
    encode_batch_file(seq=0, tensors=tensors, metadata=loaded.metadata, version=loaded.version)
    return time.perf_counter() - began


def _tokenizer_rate(encode: Callable[[list[str]], Any], text: Path) -> float:
    """Tokens per second of `encode` on the text's blank-line-separated documents."""
    docs = [d for d in text.read_text(encoding="utf-8").split("\n\n") if d]
    began = time.perf_counter()
    ids, _ = encode(docs)
    return len(ids) / (time.perf_counter() - began)


def _words(line: str) -> list[str]:
    return re.findall(r"\w+", line.lower())


def _write_vocab(text: Path, path: Path) -> Path:
    """BERT's specials, then every lower-cased word and punctuation mark of the text."""
    body = text.read_text(encoding="utf-8").lower()
    pieces = sorted(set(re.findall(r"\w+|[^\w\s]", body)))
    path.write_text(
        "".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *pieces])
    )
    return path


def _write_examples(text: Path, path: Path) -> Path:
    """Each non-blank line an example, labelled by its word count modulo the labels."""
    with open(path, "w", encoding="utf-8") as f:
        for line in text.read_text(encoding="utf-8").splitlines():
            if line.strip():
                label = LABELS[len(_words(line)) % len(LABELS)]
                f.write(json.dumps({"text": line, "label": label}) + "\n")
    return path


def _write_conll(text: Path, path: Path) -> Path:
    """Each line with words a sentence, one word per line tagged by a checksum of the word."""
    out = []
    for line in text.read_text(encoding="utf-8").splitlines():
        words = _words(line)
        if words:
            out += [f"{w} {TAGS[zlib.crc32(w.encode()) % len(TAGS)]}" for w in words]
            out.append("")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path
