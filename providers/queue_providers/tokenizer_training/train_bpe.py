"""Train a byte-level BPE tokenizer on local text, for text_lm's `tokenizer = "hf"`.

    python -m queue_providers.tokenizer_training.train_bpe --input corpus/*.txt --separator "" \\
        --vocab-size 8192 --out tokenizer.json

Documents are read exactly as text_lm reads them (same formats, separator and text_key), so
the tokenizer learns from the text it will encode. The result is a tokenizers `tokenizer.json`
with one special token, the end-of-text token (default "<|endoftext|>"), which text_lm finds on
its own. Byte-level means every byte sequence can be encoded, so nothing maps to UNK.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from queue_providers.text.files import discover
from queue_providers.text.plan import iter_corpus
from queue_providers.text.readers import ReadOptions
from queue_providers.tokenizer_training.train_cli import TrainerCommand, write_output


def corpus_texts(
    inputs: Sequence[str],
    *,
    separator: str | None = None,
    text_key: str = "text",
    format: str = "auto",
    max_documents: int | None = None,
) -> Iterator[str]:
    """The documents of `inputs`, streamed in canonical order."""
    files = discover(list(inputs), format=format, one_doc_per_file=separator is None)
    opts = ReadOptions(separator=separator, text_key=text_key)
    for n, (_, _, text) in enumerate(iter_corpus(files, opts)):
        if max_documents is not None and n >= max_documents:
            return
        yield text


def train_bpe(
    inputs: Sequence[str],
    out: Path,
    *,
    vocab_size: int,
    separator: str | None = None,
    text_key: str = "text",
    format: str = "auto",
    eos_token: str = "<|endoftext|>",
    min_frequency: int = 2,
    max_documents: int | None = None,
    show_progress: bool = False,
) -> Path:
    """Train, save to `out` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    texts = corpus_texts(
        inputs, separator=separator, text_key=text_key, format=format, max_documents=max_documents
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return write_output(out, tok.to_str(pretty=True).encode("utf-8"))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--separator",
        default=None,
        help='text: a separator line ("" for blank lines); unset: a document per file',
    )
    parser.add_argument("--text-key", default="text", help="JSONL key or Parquet column")
    parser.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
    parser.add_argument("--eos-token", default="<|endoftext|>")
    parser.add_argument(
        "--max-documents", type=int, default=None, help="train on at most this many documents"
    )


def _train(args: argparse.Namespace) -> Path:
    return train_bpe(
        args.input,
        args.out,
        vocab_size=args.vocab_size,
        separator=args.separator,
        text_key=args.text_key,
        format=args.format,
        eos_token=args.eos_token,
        min_frequency=args.min_frequency,
        max_documents=args.max_documents,
        show_progress=args.progress,
    )


COMMAND = TrainerCommand(
    name="train_bpe",
    description=__doc__.split("\n")[0],
    input_help="files, folders or globs of .txt/.jsonl/.parquet",
    out_help="where to write tokenizer.json",
    min_vocab_size=257,
    min_vocab_why="256 bytes and the end-of-text token",
    add_arguments=_add_arguments,
    train=_train,
)
main = COMMAND.main

if __name__ == "__main__":
    sys.exit(main())
