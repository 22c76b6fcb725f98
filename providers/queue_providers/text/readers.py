"""Documents out of one range of one file, read as a stream.

Every document has a *key*, an int that says where it begins and that can be sought to:
  - text, one document per file: 0.
  - text with a separator: the byte offset of the separator line before it (0 for the file's
    first document). A separator line is a line that equals `separator` once blanks at both
    ends are removed; separator "" therefore splits on blank lines. A document is the lines
    between two separator lines, without the line break that ends its last line.
  - JSONL: the byte offset of its line.
  - Parquet and Arrow: its row number.

`iter_docs(file, start, end)` yields (key, text) for the documents whose key lies in
[start, end), in file order; with `resume=key` it starts at that document instead. Byte ranges
may start mid-line: the reader syncs on the next line break, which is unambiguous, so cutting a
file at any offsets gives every document to exactly one range. Documents that are empty or
only whitespace are skipped everywhere, so counting and reading agree.

Invalid UTF-8 follows `utf8_errors` (reading.py). separated.py reads text split by separator
lines, records.py JSONL, Parquet and Arrow; a text file without a separator is one document.
A file may be local or at a URL: each reader opens it through queue_providers.remote, which
streams a remote object in cached blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from queue_providers.remote import read_input
from queue_providers.text.files import SourceFile
from queue_providers.text.reading import Doc, ReadOptions, decode, too_large
from queue_providers.text.records import iter_arrow, iter_jsonl, iter_parquet
from queue_providers.text.separated import iter_separated

__all__ = ["Doc", "ReadOptions", "iter_docs"]


def _iter_whole(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    first = resume if resume is not None else start
    if first > 0 or end <= 0:
        return
    if sf.size > opts.max_document_bytes:
        raise too_large(sf.path, 0, sf.size, opts)
    data = read_input(sf.path)
    if data and not data.isspace():
        yield 0, decode(data, opts, str(sf.path), 0)


def iter_docs(
    sf: SourceFile, start: int, end: int, opts: ReadOptions, resume: int | None = None
) -> Iterator[Doc]:
    """(key, text) for the documents of `sf` whose key lies in [start, end), or from `resume`."""
    if sf.format == "jsonl":
        return iter_jsonl(sf, start, end, resume, opts)
    if sf.format == "parquet":
        return iter_parquet(sf, start, end, resume, opts)
    if sf.format == "arrow":
        return iter_arrow(sf, start, end, resume, opts)
    if opts.separator is None:
        return _iter_whole(sf, start, end, resume, opts)
    return iter_separated(sf, start, end, resume, opts)
