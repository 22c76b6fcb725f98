"""Documents out of one range of one file, read as a stream.

Every document has a *key*, an int that says where it begins and that can be sought to:
  - text, one document per file: 0.
  - text with a separator: the byte offset of the separator line before it (0 for the file's
    first document). A separator line is a line that equals `separator` once blanks at both
    ends are removed; separator "" therefore splits on blank lines. A document is the lines
    between two separator lines, without the line break that ends its last line.
  - JSONL: the byte offset of its line.
  - Parquet: its row number.

`iter_docs(file, start, end)` yields (key, text) for the documents whose key lies in
[start, end), in file order; with `resume=key` it starts at that document instead. Byte ranges
may start mid-line: the reader syncs on the next line break, which is unambiguous, so cutting a
file at any offsets gives every document to exactly one range. Documents that are empty or
only whitespace are skipped everywhere, so counting and reading agree.

Invalid UTF-8 follows `utf8_errors`: "replace" substitutes U+FFFD for each invalid sequence
(Python's decoder rule), "error" raises CorpusError naming the file and byte offset. Lone
surrogates that JSON escapes can spell ("\\ud800") count as invalid UTF-8 too.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from queue_client.errors import ConfigError
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import SourceFile

Doc = tuple[int, str]

_BLANKS = rb"[ \t\r\f\v]*"


@dataclass(frozen=True)
class ReadOptions:
    separator: str | None = None
    text_key: str = "text"
    utf8_errors: str = "replace"
    max_document_bytes: int = 64 << 20
    read_bytes: int = 1 << 20

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


def _separator_re(separator: str) -> re.Pattern[bytes]:
    # The leading "\n" gives the regex engine a literal to search for, so finding separator
    # lines costs one scan per line break, not one match attempt per byte.
    core = re.escape(separator.strip().encode("utf-8"))
    return re.compile(rb"\n" + _BLANKS + core + _BLANKS + rb"(?=\n)")


def _first_line_re(separator: str) -> re.Pattern[bytes]:
    core = re.escape(separator.strip().encode("utf-8"))
    return re.compile(_BLANKS + core + _BLANKS + rb"(?=\n)")


def _decode(data: bytes, opts: ReadOptions, where: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if opts.utf8_errors == "error":
            raise CorpusError(
                f"{where}: invalid UTF-8 at byte {offset + exc.start} "
                "(set utf8_errors='replace' to substitute U+FFFD)"
            ) from None
        return data.decode("utf-8", errors="replace")


def _too_large(path: Path, offset: int, size: int, opts: ReadOptions) -> CorpusError:
    return CorpusError(
        f"{path}: the document at byte {offset} is larger than max_document_bytes="
        f"{opts.max_document_bytes} ({size} bytes so far): split it or raise the limit"
    )


def _next_line_start(f: BinaryIO, pos: int) -> int:
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


def line_number(path: Path, offset: int) -> int:
    """1-based number of the line that starts at byte `offset` (counted only for errors)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def _iter_separated(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    assert opts.separator is not None
    sep_re, first_re = _separator_re(opts.separator), _first_line_re(opts.separator)
    where = str(sf.path)
    with open(sf.path, "rb") as f:
        if resume is not None:
            pos, key = resume, resume
        elif start == 0:
            pos, key = 0, 0
        else:
            pos, key = _next_line_start(f, start), None  # skip to the first separator line
        f.seek(pos)
        buf = bytearray()
        base = pos  # file offset of buf[0]
        doc_start = 0  # where the current document's text begins, in buf
        scan = 0  # the first line of buf not yet looked at; always a line start
        while True:
            data = f.read(_read_size(opts, base + len(buf), end))
            eof = not data
            buf += data
            if eof:
                if buf and not buf.endswith(b"\n"):
                    buf += b"\n"
                cut = len(buf)
            else:
                cut = buf.rfind(b"\n", scan) + 1
            if cut > scan:
                # Separator lines in [scan, cut), as (start, end): the first line by itself, the
                # rest after a "\n". Lazily: a range ending early stops the search there.
                first = first_re.match(buf, scan, cut)
                lines = itertools.chain(
                    [(scan, first.end())] if first else [],
                    ((m.start() + 1, m.end()) for m in sep_re.finditer(buf, scan, cut)),
                )
                for line_start, line_end in lines:
                    if key is not None:
                        doc = _finish(buf, doc_start, line_start - 1)
                        if doc is not None:
                            yield key, _decode(doc, opts, where, base + doc_start)
                    if base + line_start >= end:
                        return
                    key = base + line_start
                    doc_start = line_end + 1
                scan = cut
            if eof:
                if key is not None:
                    doc = _finish(buf, doc_start, len(buf) - 1)
                    if doc is not None:
                        yield key, _decode(doc, opts, where, base + doc_start)
                return
            keep = doc_start if key is not None else scan
            del buf[:keep]
            base += keep
            doc_start -= keep
            scan -= keep
            if len(buf) > opts.max_document_bytes:
                raise _too_large(sf.path, base + max(doc_start, 0), len(buf), opts)


def _read_size(opts: ReadOptions, offset: int, end: int) -> int:
    """Read what the range still needs, in 64 KiB to read_bytes pieces: a small range must
    not read (and scan) a whole 1 MiB block past its end."""
    return min(opts.read_bytes, max(1 << 16, end - offset))


def _finish(buf: bytearray, start: int, stop: int) -> bytes | None:
    """buf[start:stop] without a trailing "\\r", or None when it is blank."""
    if stop <= start:
        return None
    doc = bytes(buf[start:stop])
    if doc.endswith(b"\r"):
        doc = doc[:-1]
    if not doc or doc.isspace():
        return None
    return doc


def _iter_jsonl(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    key_name = opts.text_key
    with open(sf.path, "rb") as f:
        pos = resume if resume is not None else _next_line_start(f, start)
        f.seek(pos)
        tail = b""
        while True:
            data = f.read(_read_size(opts, pos + len(tail), end))
            eof = not data
            block = tail + data
            if eof:
                lines = block.split(b"\n")
                tail = b""
            else:
                lines = block.split(b"\n")
                tail = lines.pop()
                if len(tail) > opts.max_document_bytes:
                    raise _too_large(sf.path, pos, len(tail), opts)
            for line in lines:
                here = pos
                pos += len(line) + 1
                if here >= end:
                    return
                if not line or line.isspace():
                    continue
                if len(line) > opts.max_document_bytes:
                    raise _too_large(sf.path, here, len(line), opts)
                text = _json_text(line, sf.path, here, key_name, opts)
                if text and not text.isspace():
                    yield here, text
            if eof:
                return


def _json_text(line: bytes, path: Path, offset: int, key: str, opts: ReadOptions) -> str:
    def where() -> str:
        return f"{path}:{line_number(path, offset)}"

    try:
        try:
            obj = json.loads(line)
        except UnicodeDecodeError:
            obj = json.loads(_decode(line, opts, where(), offset))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where()}: not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise CorpusError(
            f"{where()}: expected a JSON object with key {key!r}, got a {type(obj).__name__}"
        )
    if key not in obj:
        shown = sorted(obj)[:10]
        raise CorpusError(f"{where()}: no key {key!r} (the object has keys {shown}; set text_key)")
    text = obj[key]
    if not isinstance(text, str):
        raise CorpusError(
            f"{where()}: key {key!r} holds a {type(text).__name__}, expected a string"
        )
    if not text.isascii():
        text = _no_surrogates(text, opts, where)
    return text


def _no_surrogates(text: str, opts: ReadOptions, where: Callable[[], str]) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        if opts.utf8_errors == "error":
            raise CorpusError(
                f"{where()}: the text holds a lone surrogate at character {exc.start}, which is not "
                "valid UTF-8 (set utf8_errors='replace' to substitute U+FFFD)"
            ) from None
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _iter_parquet(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = resume if resume is not None else start
    with pq.ParquetFile(sf.path) as pf:
        names = pf.schema_arrow.names
        if opts.text_key not in names:
            raise CorpusError(
                f"{sf.path}: no column {opts.text_key!r} (columns: {names}; set text_key)"
            )
        kind = pf.schema_arrow.field(opts.text_key).type
        if not (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
        ):
            raise CorpusError(
                f"{sf.path}: column {opts.text_key!r} has type {kind}, expected a string column"
            )
        row0 = 0
        for rg in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(rg).num_rows
            if row0 + rows <= first:
                row0 += rows
                continue
            if row0 >= end:
                return
            row = row0
            for batch in pf.iter_batches(batch_size=2048, row_groups=[rg], columns=[opts.text_key]):
                for value in batch.column(0).to_pylist():
                    here = row
                    row += 1
                    if here < first:
                        continue
                    if here >= end:
                        return
                    if value is None:
                        continue
                    if isinstance(value, bytes):
                        if len(value) > opts.max_document_bytes:
                            raise _too_large(sf.path, here, len(value), opts)
                        value = _decode(value, opts, f"{sf.path}: row {here}", 0)
                    elif len(value) > opts.max_document_bytes:
                        raise _too_large(sf.path, here, len(value), opts)
                    if value and not value.isspace():
                        yield here, value
            row0 += rows


def _iter_whole(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    first = resume if resume is not None else start
    if first > 0 or end <= 0:
        return
    if sf.size > opts.max_document_bytes:
        raise _too_large(sf.path, 0, sf.size, opts)
    data = sf.path.read_bytes()
    if data and not data.isspace():
        yield 0, _decode(data, opts, str(sf.path), 0)


def iter_docs(
    sf: SourceFile, start: int, end: int, opts: ReadOptions, resume: int | None = None
) -> Iterator[Doc]:
    """(key, text) for the documents of `sf` whose key lies in [start, end), or from `resume`."""
    if sf.format == "jsonl":
        return _iter_jsonl(sf, start, end, resume, opts)
    if sf.format == "parquet":
        return _iter_parquet(sf, start, end, resume, opts)
    if opts.separator is None:
        return _iter_whole(sf, start, end, resume, opts)
    return _iter_separated(sf, start, end, resume, opts)
