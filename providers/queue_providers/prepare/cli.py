"""`queue-prepare` / `python -m queue_providers.prepare`: the command line of a prepare run
(and of `queue-prepare verify FOLDER`, verify.py).

A bad flag is argparse's usage error (exit 2); a fault a user can fix (a missing input, an
unknown tokenizer, an output folder that is not ours, inputs changed since the shards were
made, a full disk under the output folder) is one line on stderr naming it, exit 2. Success
prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from queue_client.errors import BatchQueueError
from queue_providers.prepare.corpus import CorpusSpec
from queue_providers.prepare.layout import MANIFEST_FILE
from queue_providers.prepare.run import MIN_SHARD_TOKENS, PrepareOptions, prepare
from queue_providers.prepare.verify import main as verify_main

PROG = "queue-prepare"
DEFAULT_SHARD_TOKENS = 100_000_000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize a text corpus once into shards of token ids and a manifest.json "
        "(the token_shards provider serves them). Run the same command again to resume.",
        epilog="queue-prepare verify FOLDER checks a prepared corpus against its manifest "
        "(every file's sha256 and document starts).",
    )
    src = p.add_argument_group("inputs (what text_lm reads)")
    where = src.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--input", nargs="+", help="files, folders, globs or URLs (text, JSONL, Parquet)"
    )
    where.add_argument("--hf-dataset", help="a Hugging Face dataset: a folder or a Hub name")
    src.add_argument("--hf-split", default="train", help="with --hf-dataset (default train)")
    src.add_argument("--hf-config", help="with --hf-dataset: its config name")
    src.add_argument("--hf-revision", help="with a Hub name: a branch, tag or commit")
    src.add_argument(
        "--format", default="auto", choices=["auto", "text", "jsonl", "parquet", "arrow"]
    )
    src.add_argument(
        "--separator",
        help='text files: a line equal to this ends a document ("" = blank lines); '
        "unset: one document per file",
    )
    src.add_argument("--text-key", default="text", help="the JSONL key or Parquet column")
    src.add_argument("--utf8-errors", default="replace", choices=["replace", "error"])
    src.add_argument("--max-document-bytes", type=int, default=64 << 20)
    src.add_argument(
        "--remote",
        type=_json_table,
        help="URL inputs: text_lm's `remote` table as JSON, e.g. "
        '\'{"storage_options": {"endpoint_url": "http://minio:9000"}}\' (credentials come '
        "from the environment, never from here)",
    )
    tok = p.add_argument_group("tokenizer")
    tok.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, char, a tokenizer.json (or folder, or cached hub name), "
        "tiktoken:ENCODING or a .tiktoken ranks file (default byte)",
    )
    tok.add_argument("--eos-token", help="the end-of-text token (default: found by name)")
    tok.add_argument("--tiktoken-pattern", help="a .tiktoken ranks file's split regex")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, required=True, help="the output folder")
    o.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard, at least {MIN_SHARD_TOKENS} (default {DEFAULT_SHARD_TOKENS:,})",
    )
    o.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    o.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a previous run's shards in --out and prepare again",
    )
    o.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stderr.isatty(),
        help="show a progress bar (default: when stderr is a terminal)",
    )
    return p


def _json_table(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def options(args: argparse.Namespace) -> PrepareOptions:
    corpus = CorpusSpec(
        sources=tuple(args.input) if args.input else None,
        hf_dataset=args.hf_dataset,
        hf_split=args.hf_split,
        hf_config=args.hf_config,
        hf_revision=args.hf_revision,
        format=args.format,
        separator=args.separator,
        text_key=args.text_key,
        utf8_errors=args.utf8_errors,
        max_document_bytes=args.max_document_bytes,
        cache_dir=args.out,
        remote=args.remote,
    )
    return PrepareOptions(
        corpus=corpus,
        tokenizer=args.tokenizer,
        out=args.out,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        eos_token=args.eos_token,
        tiktoken_pattern=args.tiktoken_pattern,
        overwrite=args.overwrite,
        progress=args.progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["verify"]:  # a finished corpus checked against its manifest
        return verify_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        result = prepare(options(args))
    except BatchQueueError as exc:
        # Shared helpers start their messages with who asked (queue-prepare): say it once.
        print(f"{PROG}: error: {str(exc).removeprefix(f'{PROG}: ')}", file=sys.stderr)
        return 2
    m = result.manifest
    how = (
        "already complete, verified"
        if result.already_complete
        else f"{result.tokens_per_s / 1e6:.2f} M tokens/s"
        + (
            f", {result.resumed_shards} shard(s) kept from an earlier run"
            if result.resumed_shards
            else ""
        )
    )
    print(
        f"{args.out / MANIFEST_FILE}: {m['total_tokens']:,} tokens, {m['total_documents']:,} "
        f"documents in {len(m['shards'])} shard(s) of {m['dtype']} ({how})"
    )
    return 0
