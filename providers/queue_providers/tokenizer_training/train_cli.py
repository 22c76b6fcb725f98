"""The command line that train_bpe and train_wordpiece share.

Both train a tokenizer on local text and write it to --out, so both take the same core flags
(--input, --vocab-size, --out, --min-frequency, --progress), answer a bad flag or bad input
the same way (a message naming the tool on stderr and exit code 2, as argparse does) and
write --out atomically, so an interrupted run never leaves half a tokenizer where a config
points. Each tool adds its own flags and the function that trains from the parsed args.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from queue_client.errors import BatchQueueError
from queue_client.format.layout import atomic_write


@dataclass(frozen=True)
class TrainerCommand:
    """One tokenizer-training tool: `python -m queue_providers.<name>`."""

    name: str
    description: str
    input_help: str
    out_help: str
    min_vocab_size: int
    min_vocab_why: str  # what the smallest vocabulary holds, for the error message
    add_arguments: Callable[[argparse.ArgumentParser], None]
    train: Callable[[argparse.Namespace], Path]  # trains, writes args.out, returns the path

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=f"python -m queue_providers.{self.name}", description=self.description
        )
        parser.add_argument("--input", nargs="+", required=True, help=self.input_help)
        parser.add_argument(
            "--vocab-size", type=int, required=True, help="vocabulary size, special tokens included"
        )
        parser.add_argument("--out", type=Path, required=True, help=self.out_help)
        parser.add_argument(
            "--min-frequency", type=int, default=2, help="rarest pair that may merge (default 2)"
        )
        parser.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=sys.stderr.isatty(),
            help="show progress while training (default: when stderr is a terminal)",
        )
        self.add_arguments(parser)
        return parser

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Parse `argv`, train, write; the process exit code."""
        parser = self.parser()
        args = parser.parse_args(argv)
        if args.vocab_size < self.min_vocab_size:
            parser.error(
                f"--vocab-size must be at least {self.min_vocab_size} ({self.min_vocab_why})"
            )
        try:
            out = self.train(args)
        except BatchQueueError as exc:
            message = str(exc).removeprefix(f"{self.name}: ")  # a message may name us already
            print(f"{self.name}: error: {message}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0


def write_output(out: Path, data: bytes) -> Path:
    """Write a trained tokenizer to `out` atomically, making its folder if needed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, data)
    return out
