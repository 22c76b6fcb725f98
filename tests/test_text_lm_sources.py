"""text_lm sources: what a document is in each format, and that any cut of a file into ranges
gives every document to exactly one range; plus each bad input's error names the fault."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from queue_client.errors import ConfigError
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import discover
from queue_providers.text.plan import find_boundary, make_chunks, split_ranges
from queue_providers.text.readers import ReadOptions, iter_docs

# Tricky on purpose: runs of blank lines, blanks made of spaces and \r, a separator first and
# last, CRLF lines, a missing final newline, and the separator text inside a line.
TRICKY = (
    "\n\nfirst doc line one\nline two\n\n\n\n  \t\nsecond\r\n\r\nthird has <|endoftext|> inline\n"
    "<|endoftext|>\nfourth\n   <|endoftext|>   \n\nfifth: café ☕\nlast line, no newline"
)


def reference_docs(data: bytes, separator: str) -> list[str]:
    """The documented rule, written the slow obvious way."""
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    docs, cur = [], []
    for line in lines:
        if line.strip() == separator.strip().encode():
            docs.append(cur)
            cur = []
        else:
            cur.append(line)
    docs.append(cur)
    out = []
    for d in docs:
        text = b"\n".join(d)
        if text.endswith(b"\r"):
            text = text[:-1]
        if text.strip():
            out.append(text.decode())
    return out


def read_all(sf, opts, cuts):
    docs = []
    for a, b in itertools.pairwise(cuts):
        docs.extend(iter_docs(sf, a, b, opts))
    return docs


@pytest.mark.parametrize("separator", ["", "<|endoftext|>"])
def test_any_cut_of_a_separated_file_reads_each_document_once(
    tmp_path: Path, separator: str
) -> None:
    path = tmp_path / "c.txt"
    data = TRICKY.encode()
    path.write_bytes(data)
    (sf,) = discover(str(path), one_doc_per_file=False)
    want = reference_docs(data, separator)
    rnd = random.Random(0)
    for read_bytes in (3, 7, 1 << 20):  # tiny reads cross every block boundary
        opts = ReadOptions(separator=separator, read_bytes=read_bytes)
        for _ in range(40):
            cuts = sorted({0, len(data), *rnd.sample(range(1, len(data)), rnd.randint(0, 12))})
            docs = read_all(sf, opts, cuts)
            assert [t for _, t in docs] == want
            keys = [k for k, _ in docs]
            assert keys == sorted(set(keys))
            # Resuming at any document's key reads the rest of the file from there.
            i = rnd.randrange(len(docs))
            assert list(iter_docs(sf, 0, len(data), opts, resume=keys[i])) == docs[i:]


def test_jsonl_any_cut_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [{"text": f"row {i} " + "x" * (i % 7), "id": i} for i in range(50)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(10, "   ")  # blank lines are skipped
    lines.insert(20, json.dumps({"text": ""}))  # and so are empty texts
    path.write_text("\n".join(lines))  # no final newline
    (sf,) = discover(str(path))
    opts = ReadOptions(read_bytes=64)
    rnd = random.Random(1)
    size = path.stat().st_size
    for _ in range(30):
        cuts = sorted({0, size, *rnd.sample(range(1, size), rnd.randint(0, 10))})
        assert [t for _, t in read_all(sf, opts, cuts)] == [r["text"] for r in rows]


def test_parquet_rows_across_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    texts = [f"parquet doc {i}" if i % 9 else None for i in range(100)]
    pq.write_table(pa.table({"text": texts, "n": list(range(100))}), path, row_group_size=17)
    (sf,) = discover(str(path))
    assert sf.extent == 100
    opts = ReadOptions()
    want = [(i, t) for i, t in enumerate(texts) if t]
    assert read_all(sf, opts, [0, 5, 17, 40, 41, 100]) == want
    assert list(iter_docs(sf, 0, 100, opts, resume=50)) == [d for d in want if d[0] >= 50]


def test_parquet_missing_column_names_it(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a"]}), path)
    (sf,) = discover(str(path))
    with pytest.raises(CorpusError, match=r"c\.parquet: no column 'text' \(columns: \['body'\]"):
        list(iter_docs(sf, 0, sf.extent, ReadOptions()))


def test_a_document_per_file_and_discovery(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("two")
    (tmp_path / "1.txt").write_text("one\n\nstill one")
    (tmp_path / "3.txt").write_text("  \n")  # blank: no document
    (tmp_path / "skip.bin").write_bytes(b"\0")
    files = discover(str(tmp_path))
    assert [f.path.name for f in files] == ["1.txt", "3.txt", "2.txt"]  # sorted by full path
    docs = [t for f in files for _, t in iter_docs(f, 0, f.extent, ReadOptions())]
    assert docs == ["one\n\nstill one", "two"]
    assert [f.path.name for f in discover(str(tmp_path / "*.txt"))] == ["1.txt", "3.txt"]
    with pytest.raises(ConfigError, match="matches no files"):
        discover(str(tmp_path / "nothing*.txt"))
    with pytest.raises(ConfigError, match=r"skip\.bin"):
        discover(str(tmp_path / "*.bin"))


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n')
    (sf,) = discover(str(path))
    it = iter_docs(sf, 0, sf.extent, ReadOptions())
    assert next(it)[1] == "ok"
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3: not valid JSON"):
        list(it)


def test_missing_or_wrong_text_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "k.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (sf,) = discover(str(path))
    with pytest.raises(
        CorpusError, match=r"k\.jsonl:2: no key 'text' \(the object has keys \['body'\]"
    ):
        list(iter_docs(sf, 0, sf.extent, ReadOptions()))
    path.write_text('{"text": 5}\n')
    (sf,) = discover(str(path))
    with pytest.raises(CorpusError, match=r"k\.jsonl:1: key 'text' holds a int"):
        list(iter_docs(sf, 0, sf.extent, ReadOptions()))


def test_invalid_utf8_is_replaced_or_rejected(tmp_path: Path) -> None:
    path = tmp_path / "u.txt"
    path.write_bytes(b"good\n\nbad \xff byte\n")
    (sf,) = discover(str(path), one_doc_per_file=False)
    docs = [t for _, t in iter_docs(sf, 0, sf.extent, ReadOptions(separator=""))]
    assert docs == ["good", "bad \ufffd byte"]
    with pytest.raises(CorpusError, match=r"u\.txt: invalid UTF-8 at byte 10"):
        list(iter_docs(sf, 0, sf.extent, ReadOptions(separator="", utf8_errors="error")))
    js = tmp_path / "s.jsonl"
    js.write_text('{"text": "lone \\ud800 surrogate"}\n')
    (sf,) = discover(str(js))
    assert next(iter_docs(sf, 0, sf.extent, ReadOptions()))[1].startswith("lone \ufffd")
    with pytest.raises(CorpusError, match=r"s\.jsonl:1: .*lone surrogate"):
        list(iter_docs(sf, 0, sf.extent, ReadOptions(utf8_errors="error")))


def test_a_document_over_the_size_limit_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    path.write_text("small\n\n" + "y" * 5000 + "\n")
    (sf,) = discover(str(path), one_doc_per_file=False)
    opts = ReadOptions(separator="", max_document_bytes=1000, read_bytes=256)
    with pytest.raises(
        CorpusError,
        match=r"big\.txt: the document at byte 7 is larger than max_document_bytes=1000",
    ):
        list(iter_docs(sf, 0, sf.extent, opts))
    (whole,) = discover(str(path))
    with pytest.raises(CorpusError, match=r"big\.txt: the document at byte 0"):
        list(iter_docs(whole, 0, 1, ReadOptions(max_document_bytes=1000)))


def test_empty_corpus_and_too_large_eval_take(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("\n \n")
    files = discover(str(tmp_path / "a.txt"), one_doc_per_file=False)
    with pytest.raises(CorpusError, match=r"holds no documents"):
        find_boundary(files, ReadOptions(separator=""), 0, "a.txt")
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    files = discover(str(tmp_path / "a.txt"), one_doc_per_file=False)
    with pytest.raises(CorpusError, match=r"only 2 document\(s\) but eval_take=2"):
        find_boundary(files, ReadOptions(separator=""), 2, "a.txt")


def test_split_ranges_and_chunks_partition_the_corpus(tmp_path: Path) -> None:
    """val = the first eval_take documents, train the rest; chunks of each split, read in
    order, give back exactly its documents, for several worker counts."""
    paths = []
    for f in range(3):
        p = tmp_path / f"{f}.txt"
        p.write_text("".join(f"file {f} doc {i}\n\n" for i in range(30 + 10 * f)))
        paths.append(str(p))
    files = discover(paths, one_doc_per_file=False)
    opts = ReadOptions(separator="")
    every = [t for f in files for _, t in iter_docs(f, 0, f.extent, opts)]
    boundary = find_boundary(files, opts, 45, "x")
    ranges = split_ranges(files, boundary)
    for workers in (1, 2, 3, 5):
        got = {}
        for split, rng in ranges.items():
            chunks = make_chunks(files, rng, workers)
            got[split] = [
                t for c in chunks for _, t in iter_docs(files[c.file], c.start, c.end, opts)
            ]
        assert got["val"] == every[:45]
        assert got["train"] == every[45:]
