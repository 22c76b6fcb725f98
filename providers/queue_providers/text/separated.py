"""Text files cut into documents by separator lines (readers.py gives the key rules).

A separator line equals `separator` once blanks at both ends are removed, so separator ""
splits on blank lines. The file is read in blocks and scanned by one regex per block; only
the current document is kept in memory, up to max_document_bytes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from queue_providers.remote import open_input
from queue_providers.text.files import SourceFile
from queue_providers.text.reading import (
    Doc,
    ReadOptions,
    decode,
    next_line_start,
    read_size,
    too_large,
)

_BLANKS = rb"[ \t\r\f\v]*"


def _separator_re(separator: str) -> re.Pattern[bytes]:
    # The leading "\n" gives the regex engine a literal to search for, so finding separator
    # lines costs one scan per line break, not one match attempt per byte.
    core = re.escape(separator.strip().encode("utf-8"))
    return re.compile(rb"\n" + _BLANKS + core + _BLANKS + rb"(?=\n)")


def _first_line_re(separator: str) -> re.Pattern[bytes]:
    core = re.escape(separator.strip().encode("utf-8"))
    return re.compile(_BLANKS + core + _BLANKS + rb"(?=\n)")


def iter_separated(
    sf: SourceFile, start: int, end: int, resume: int | None, opts: ReadOptions
) -> Iterator[Doc]:
    assert opts.separator is not None
    sep_re, first_re = _separator_re(opts.separator), _first_line_re(opts.separator)
    where = str(sf.path)
    with open_input(sf.path) as f:
        if resume is not None:
            pos, key = resume, resume
        elif start == 0:
            pos, key = 0, 0
        else:
            pos, key = next_line_start(f, start), None  # skip to the first separator line
        f.seek(pos)
        buf = bytearray()
        base = pos  # file offset of buf[0]
        doc_start = 0  # where the current document's text begins, in buf
        scan = 0  # the first line of buf not yet looked at; always a line start
        while True:
            data = f.read(read_size(opts, base + len(buf), end))
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
                            yield key, decode(doc, opts, where, base + doc_start)
                    if base + line_start >= end:
                        return
                    key = base + line_start
                    doc_start = line_end + 1
                scan = cut
            if eof:
                if key is not None:
                    doc = _finish(buf, doc_start, len(buf) - 1)
                    if doc is not None:
                        yield key, decode(doc, opts, where, base + doc_start)
                return
            keep = doc_start if key is not None else scan
            del buf[:keep]
            base += keep
            doc_start -= keep
            scan -= keep
            if len(buf) > opts.max_document_bytes:
                raise too_large(sf.path, base + max(doc_start, 0), len(buf), opts)


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
