"""JSONL lines and Parquet or Arrow rows as documents (readers.py gives the key rules).

A JSONL document is the string under `text_key` of one line's object; a Parquet or Arrow
document is the `text_key` column of one row. Lone surrogates that JSON escapes can spell
("\\ud800") count as invalid UTF-8 and follow `utf8_errors`. Parquet at a URL is read through
a remote file: pyarrow fetches the footer, then only the row groups a range needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from queue_providers.remote import Location, arrow_source, open_input
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import SourceFile, arrow_table
from queue_providers.text.reading import (
    Doc,
    ReadOptions,
    decode,
    line_number,
    next_line_start,
    read_size,
    too_large,
)


def iter_jsonl(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    key_name = opts.text_key
    with open_input(sf.path) as f:
        pos = resume if resume is not None else next_line_start(f, start)
        f.seek(pos)
        tail = b""
        while True:
            data = f.read(read_size(opts, pos + len(tail), end))
            eof = not data
            block = tail + data
            if eof:
                lines = block.split(b"\n")
                tail = b""
            else:
                lines = block.split(b"\n")
                tail = lines.pop()
                if len(tail) > opts.max_document_bytes:
                    raise too_large(sf.path, pos, len(tail), opts)
            for line in lines:
                here = pos
                pos += len(line) + 1
                if here >= end:
                    return
                if not line or line.isspace():
                    continue
                if len(line) > opts.max_document_bytes:
                    raise too_large(sf.path, here, len(line), opts)
                text = _json_text(line, sf.path, here, key_name, opts)
                if text and not text.isspace():
                    yield here, text
            if eof:
                return


def _json_text(line: bytes, path: Location, offset: int, key: str, opts: ReadOptions) -> str:
    def where() -> str:
        return f"{path}:{line_number(path, offset)}"

    try:
        try:
            obj = json.loads(line)
        except UnicodeDecodeError:
            obj = json.loads(decode(line, opts, where(), offset))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where()}: not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise CorpusError(
            f"{where()}: expected a JSON object with key {key!r}, got a {type(obj).__name__}"
        )
    if key not in obj:
        shown = sorted(obj)[:10]
        raise CorpusError(
            f"{where()}: no key {key!r} (the object has keys {shown}; set "
            f"{opts.setting('text_key')})"
        )
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
                f"valid UTF-8 (set {opts.setting('utf8_errors', 'replace')} to substitute "
                "U+FFFD)"
            ) from None
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def iter_parquet(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    import pyarrow.parquet as pq

    first = resume if resume is not None else start
    with arrow_source(sf.path) as src, pq.ParquetFile(src) as pf:
        _check_text_column(pf.schema_arrow, sf, opts)
        row0 = 0
        for rg in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(rg).num_rows
            if row0 + rows <= first:
                row0 += rows
                continue
            if row0 >= end:
                return
            batches = pf.iter_batches(batch_size=2048, row_groups=[rg], columns=[opts.text_key])
            yield from _texts((b.column(0) for b in batches), row0, first, end, sf, opts)
            row0 += rows


def iter_arrow(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    """Rows of a local Arrow IPC file (a Hugging Face dataset's data files), memory-mapped:
    only the rows of [first, end) are touched."""
    first = resume if resume is not None else start
    table = arrow_table(sf.path)
    _check_text_column(table.schema, sf, opts)
    stop = min(end, table.num_rows)
    if first >= stop:
        return
    column = table.column(opts.text_key).slice(first, stop - first)
    pieces = (column.slice(i, 2048) for i in range(0, stop - first, 2048))
    yield from _texts(pieces, first, first, stop, sf, opts)


def _check_text_column(schema: Any, sf: SourceFile, opts: ReadOptions) -> None:
    import pyarrow as pa

    names = schema.names
    if opts.text_key not in names:
        raise CorpusError(
            f"{sf.path}: no column {opts.text_key!r} (columns: {names}; set "
            f"{opts.setting('text_key')})"
        )
    kind = schema.field(opts.text_key).type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        raise CorpusError(
            f"{sf.path}: column {opts.text_key!r} has type {kind}, expected a string column"
        )


def _texts(
    pieces: Iterable[Any], row0: int, first: int, end: int, sf: SourceFile, opts: ReadOptions
) -> Iterator[Doc]:
    """The documents of rows [first, end) among pieces (arrays of a text column) that start
    at row row0: nulls, empty and blank values skipped."""
    row = row0
    for piece in pieces:
        for value in piece.to_pylist():
            here = row
            row += 1
            if here < first or value is None:
                continue
            if here >= end:
                return
            if isinstance(value, bytes):
                if len(value) > opts.max_document_bytes:
                    raise too_large(sf.path, here, len(value), opts)
                value = decode(value, opts, f"{sf.path}: row {here}", 0)
            elif len(value) > opts.max_document_bytes:
                raise too_large(sf.path, here, len(value), opts)
            if value and not value.isspace():
                yield here, value
