"""What every reader of text_lm's sources shares: the options, UTF-8 decoding by the
`utf8_errors` rule, the document-size limit, and syncing a byte range on the next line start.

Invalid UTF-8 follows `utf8_errors`: "replace" substitutes U+FFFD for each invalid sequence
(Python's decoder rule), "error" raises CorpusError naming the file and byte offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

from queue_client.errors import ConfigError
from queue_providers.remote import Location, open_input
from queue_providers.text.errors import CorpusError

Doc = tuple[int, str]  # (key, text)


@dataclass(frozen=True)
class ReadOptions:
    separator: str | None = None
    text_key: str = "text"
    utf8_errors: str = "replace"
    max_document_bytes: int = 64 << 20
    read_bytes: int = 1 << 20
    # Messages name a setting as the user gave it: text_lm's config key (utf8_errors='replace')
    # or, for queue-prepare, its command-line flag (--utf8-errors replace).
    flags: bool = False

    def __post_init__(self) -> None:
        if self.separator is not None and ("\n" in self.separator or "\r" in self.separator):
            raise ConfigError(f"separator must be one line, got {self.separator!r}")
        if self.utf8_errors not in ("replace", "error"):
            raise ConfigError(f"utf8_errors must be 'replace' or 'error', got {self.utf8_errors!r}")
        if not isinstance(self.max_document_bytes, int) or self.max_document_bytes <= 0:
            raise ConfigError(
                f"max_document_bytes must be a positive int, got {self.max_document_bytes!r}"
            )
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"text_key must be a non-empty string, got {self.text_key!r}")

    def setting(self, key: str, value: object = None) -> str:
        """`key` (with `value`, if given) as the user writes it: a config key or a flag."""
        if self.flags:
            flag = "--" + key.replace("_", "-")
            return flag if value is None else f"{flag} {value}"
        return key if value is None else f"{key}={value!r}"


def decode(data: bytes, opts: ReadOptions, where: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if opts.utf8_errors == "error":
            raise CorpusError(
                f"{where}: invalid UTF-8 at byte {offset + exc.start} "
                f"(set {opts.setting('utf8_errors', 'replace')} to substitute U+FFFD)"
            ) from None
        return data.decode("utf-8", errors="replace")


def too_large(path: Location, offset: int, size: int, opts: ReadOptions) -> CorpusError:
    return CorpusError(
        f"{path}: the document at byte {offset} is larger than "
        f"{opts.setting('max_document_bytes', opts.max_document_bytes)} ({size} bytes so "
        "far): split it or raise the limit"
    )


def next_line_start(f: BinaryIO, pos: int) -> int:
    """The first line start at or after `pos` (or the file's size if none is)."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    offset = pos - 1
    while True:
        block = f.read(1 << 16)
        if not block:
            return offset
        i = block.find(b"\n")
        if i >= 0:
            return offset + i + 1
        offset += len(block)


def line_number(path: Location, offset: int) -> int:
    """1-based number of the line that starts at byte `offset` (counted only for errors)."""
    count, done = 1, 0
    with open_input(path) as f:
        while done < offset:
            block = f.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def read_size(opts: ReadOptions, offset: int, end: int) -> int:
    """Read what the range still needs, in 64 KiB to read_bytes pieces: a small range must
    not read (and scan) a whole 1 MiB block past its end."""
    return min(opts.read_bytes, max(1 << 16, end - offset))
