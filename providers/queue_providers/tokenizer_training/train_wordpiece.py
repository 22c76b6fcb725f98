"""Train a BERT WordPiece tokenizer on local text files, for bert_mlm and the classifiers.

    python -m queue_providers.tokenizer_training.train_wordpiece --input corpus.txt --vocab-size 8000 --out tokenizer.json

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
from queue_providers.tokenized.wordpiece import BERT_SPECIALS, bert_wordpiece
from queue_providers.tokenizer_training.train_cli import TrainerCommand, write_output


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
    if out.suffix == ".txt":
        vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return write_output(out, "".join(f"{token}\n" for token, _ in vocab).encode("utf-8"))
    return write_output(out, tok.to_str(pretty=True).encode("utf-8"))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-lowercase", dest="lowercase", action="store_false", help="keep case (cased BERT)"
    )


def _train(args: argparse.Namespace) -> Path:
    return train_wordpiece(
        args.input,
        vocab_size=args.vocab_size,
        out=args.out,
        lowercase=args.lowercase,
        min_frequency=args.min_frequency,
        show_progress=args.progress,
    )


COMMAND = TrainerCommand(
    name="train_wordpiece",
    description=__doc__.split("\n\n")[0],
    input_help="text files to train on",
    out_help="tokenizer.json to write (or vocab.txt, by suffix)",
    min_vocab_size=len(BERT_SPECIALS) + 1,
    min_vocab_why=f"the {len(BERT_SPECIALS)} special tokens and one more",
    add_arguments=_add_arguments,
    train=_train,
)
main = COMMAND.main

if __name__ == "__main__":
    sys.exit(main())
