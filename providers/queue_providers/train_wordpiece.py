"""Train a BERT WordPiece tokenizer on local text files, for bert_mlm and the classifiers.

    python -m queue_providers.train_wordpiece --input corpus.txt --vocab-size 8000 --out tokenizer.json

The result is a tokenizer.json (BertNormalizer, BertPreTokenizer, WordPiece with "##"
continuations) whose first ids are [PAD] [UNK] [CLS] [SEP] [MASK]. With --out ending in .txt,
a BERT vocab.txt (one token per line) is written instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from queue_client.errors import ConfigError
from queue_providers.tokenize_util import BERT_SPECIALS, bert_wordpiece


def train_wordpiece(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    vocab_size: int,
    out: str | os.PathLike[str],
    lowercase: bool = True,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Path:
    """Train on `inputs` and write the tokenizer to `out`; returns `out`."""
    from tokenizers import trainers

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"train_wordpiece: input file(s) {missing} do not exist")
    if vocab_size <= len(BERT_SPECIALS):
        raise ConfigError(
            f"train_wordpiece: --vocab-size must exceed {len(BERT_SPECIALS)}, got {vocab_size}"
        )
    tok = bert_wordpiece(None, lowercase=lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(BERT_SPECIALS),
        show_progress=show_progress,
    )
    tok.train([str(p) for p in paths], trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".txt":
        vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        out.write_text("".join(f"{token}\n" for token, _ in vocab), encoding="utf-8")
    else:
        tok.save(str(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m queue_providers.train_wordpiece", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help="text files to train on"
    )
    parser.add_argument(
        "--vocab-size", type=int, required=True, help="vocabulary size, special tokens included"
    )
    parser.add_argument(
        "--out", required=True, help="tokenizer.json to write (or vocab.txt, by suffix)"
    )
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="rarest pair that may merge (default 2)"
    )
    parser.add_argument(
        "--no-lowercase", dest="lowercase", action="store_false", help="keep case (cased BERT)"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stderr.isatty(),
        help="show a progress bar while training (default: when stderr is a terminal)",
    )
    args = parser.parse_args(argv)
    try:
        out = train_wordpiece(
            args.input,
            vocab_size=args.vocab_size,
            out=args.out,
            lowercase=args.lowercase,
            min_frequency=args.min_frequency,
            show_progress=args.progress,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
