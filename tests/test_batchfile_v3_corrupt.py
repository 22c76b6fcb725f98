"""Malformed batch files of format 3, made by hand and fuzzed with hypothesis (truncations,
flipped bytes, random headers, random schemas): each loads, every tensor inside its data, or
raises CorruptBatchFile naming the file and the fault; never another exception, never a crash.
Both loaders alike: load_batch_file (a mapped file) and load_batch_bytes (streamed bytes)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_client.errors import CorruptBatchFile
from queue_client.format import batchfile_v3 as v3
from queue_client.format.batchfile import encode_batch_file, load_batch_bytes, load_batch_file
from queue_client.format.schema import DTYPES

NAME = "1700000000123-0000000004-2.pt"


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / NAME
    path.write_bytes(data)
    return path


# ---- malformed files ----------------------------------------------------------------------


def _good() -> bytes:
    """x: int32 [2, 3, 4] at 0 (96 bytes), y: uint8 [2, 3, 4] at 128; 152 data bytes."""
    x = torch.arange(24, dtype=torch.int32).view(2, 3, 4)
    tensors = {"x": x, "y": x.to(torch.uint8)}
    return encode_batch_file(seq=4, tensors=tensors, metadata={"split": "train"}).data


def _parts(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(the header, the data) of a version 3 file."""
    n = struct.unpack_from("<Q", data, 16)[0]
    start = -(-(24 + n) // 64) * 64
    return json.loads(data[24 : 24 + n]), data[start:]


def _pack(
    header: Any, data: bytes, *, text: bytes | None = None, version: int = 3, **kw: int
) -> bytes:
    """A file of this header (or raw header text) and data, its prefix as asked."""
    if text is None:
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    length = kw.get("length", len(text))
    prefix = struct.pack(
        "<8sIIQ", kw.get("magic", v3.MAGIC), version, kw.get("reserved", 0), length
    )
    start = -(-(24 + len(text)) // 64) * 64
    return prefix + text + bytes(start - 24 - len(text)) + data


def _edit(*edits: Any) -> bytes:
    """The good file with header[path...] set to value, for each (path, value) pair given;
    "tensors.1.offset" is entry 1's offset."""
    header, data = _parts(_good())
    for path, value in zip(edits[::2], edits[1::2], strict=True):
        *keys, last = path.split(".")
        node = header
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        index = int(last) if isinstance(node, list) else last
        if value is _DELETE:
            del node[index]
        else:
            node[index] = value
    return _pack(header, data)


_DELETE = object()
_GOOD_HEADER, _GOOD_DATA = _parts(_good())

MALFORMED = {
    "empty": (b"", "cannot be loaded"),
    "prefix cut": (_good()[:20], "truncated"),
    "bad magic": (b"BQBATCX\x00" + _good()[8:], "cannot be loaded"),
    "newer version": (
        _pack(_GOOD_HEADER, _GOOD_DATA, version=4),
        "newer than this reader's 3; upgrade",
    ),
    "older version in a v3 prefix": (
        _pack(_GOOD_HEADER, _GOOD_DATA, version=2),
        "prefix says version 2",
    ),
    "reserved set": (_pack(_GOOD_HEADER, _GOOD_DATA, reserved=1), "reserved 1"),
    "header length past the end": (
        _pack(_GOOD_HEADER, _GOOD_DATA, length=10**6),
        "runs past the end",
    ),
    "header length 2**64-1": (
        _pack(_GOOD_HEADER, _GOOD_DATA, length=2**64 - 1),
        "runs past the end",
    ),
    "bad json": (_pack(None, _GOOD_DATA, text=b'{"metadata": {'), "not JSON"),
    "not utf-8": (_pack(None, _GOOD_DATA, text=b'{"\xff": 1}'), "not JSON"),
    "NaN": (_pack(None, _GOOD_DATA, text=b'{"metadata": NaN}'), "not JSON"),
    "deep nesting": (_pack(None, b"", text=b"[" * 100_000 + b"]" * 100_000), "not JSON"),
    "header a list": (_pack([1], _GOOD_DATA), "not a table"),
    "unknown key": (_pack({**_GOOD_HEADER, "evil": 1}, _GOOD_DATA), "not a table"),
    "no tensors key": (_edit("tensors", _DELETE), "lacks \\['tensors'\\]"),
    "metadata a list": (_edit("metadata", [1, 2]), "metadata is a list"),
    "no tensors": (_edit("tensors", []), "tensors missing"),
    "tensors a dict": (_edit("tensors", {"x": 1}), "not a list"),
    "entry not a table": (_edit("tensors.0", [1]), "not a table of"),
    "entry key missing": (_edit("tensors.0.nbytes", _DELETE), "not a table of"),
    "unknown dtype": (_edit("tensors.0.dtype", "complex64"), "unknown dtype 'complex64'"),
    "dtype not a str": (_edit("tensors.0.dtype", ["int32"]), "unknown dtype"),
    "shape not its length": (_edit("tensors.0.shape", [2, 3, 5]), "is not 96 bytes"),
    "negative shape": (_edit("tensors.0.shape", [-2, -3, 4]), "not a list of sizes"),
    "float shape": (_edit("tensors.0.shape", [2.0, 3, 4]), "not a list of sizes"),
    "huge shape": (_edit("tensors.0.shape", [2**70, 0]), "not a list of sizes"),
    "negative offset (into the header)": (_edit("tensors.0.offset", -64), "offset -64"),
    "offset not aligned": (_edit("tensors.1.offset", 100), "not a multiple of 64"),
    "overlap": (_edit("tensors.1.offset", 64), "overlap"),
    "repeated name": (_edit("tensors.1.name", "x"), "repeated"),
    "name not a str": (_edit("tensors.1.name", 7), "not a str"),
    "data_bytes too big": (_edit("data_bytes", 10**9), "the header says the data"),
    "data_bytes a bool": (_edit("data_bytes", True), "the header says the data"),
    "trailing bytes": (_good() + b"\x00", "the header says the data"),
    "cut in the data": (_good()[:-1], "the header says the data"),
    "not num_batches": (_edit("metadata.num_batches", 3), "does not hold 3 batches"),
    "a batch tensor of one dim": (_edit("tensors.0.shape", [24]), "does not hold 2 batches"),
    "offset past the data": (_edit("tensors.1.offset", 192), "run past the data"),
    "a schema of junk": (
        _edit(
            "metadata.batch_size", 3, "metadata.schema", [{"name": 1, "dtype": "int64", "shape": 5}]
        ),
        "metadata schema is malformed",
    ),
    "a schema the tensors do not fit": (
        _edit(
            "metadata.batch_size",
            3,
            "metadata.schema",
            [{"name": "x", "dtype": "int64", "shape": [4]}],
        ),
        "stored tensors \\['y'\\] are not in the schema",
    ),
    "strides past int64": (
        _edit("tensors.0.shape", [2, 2**40, 2**40, 0], "tensors.0.nbytes", 0),
        "is not a list of sizes",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_file_is_corrupt_naming_the_file_and_the_fault(
    tmp_path: Path, case: str
) -> None:
    data, needle = MALFORMED[case]
    path = _file(tmp_path, data)
    for load in (lambda: load_batch_file(path), lambda: load_batch_bytes(data, str(path))):
        with pytest.raises(CorruptBatchFile, match=needle) as info:
            load()
        assert str(path) in str(info.value)


def _loads_or_is_corrupt(tmp_path: Path, data: bytes) -> None:
    """Either both loaders load it, every tensor inside the file as its entry says, or both
    raise CorruptBatchFile; nothing else, and nothing crashes."""
    path = _file(tmp_path, data)
    results = []
    for load in (lambda: load_batch_file(path), lambda: load_batch_bytes(data, str(path))):
        try:
            results.append(load())
        except CorruptBatchFile as exc:
            assert str(path) in str(exc)
            results.append(None)
    assert (results[0] is None) == (results[1] is None)
    if results[0] is not None:
        for a, b in zip(results[0].stored.values(), results[1].stored.values(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_FUZZ
@given(cut=st.integers(0, len(_good()) - 1))
def test_every_truncation_is_corrupt(tmp_path: Path, cut: int) -> None:
    data = _good()[:cut]
    path = _file(tmp_path, data)
    for load in (lambda: load_batch_file(path), lambda: load_batch_bytes(data, str(path))):
        with pytest.raises(CorruptBatchFile):
            load()


@_FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 511), st.integers(0, 255)), min_size=1, max_size=4))
def test_flipped_bytes_in_the_prefix_and_header_load_or_are_corrupt(
    tmp_path: Path, edits: list[tuple[int, int]]
) -> None:
    data = bytearray(_good())
    for at, value in edits:
        data[at % len(data)] = value
    _loads_or_is_corrupt(tmp_path, bytes(data))


_SIZES = st.one_of(st.integers(0, 8), st.integers(-3, 2**65), st.floats(), st.booleans())
_ENTRY = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["x", "y"]), st.integers()),
        "dtype": st.one_of(st.sampled_from(DTYPES), st.text(max_size=8), st.none()),
        "shape": st.one_of(st.lists(_SIZES, max_size=4), st.integers()),
        "offset": st.one_of(st.sampled_from([0, 64, 128, 192]), _SIZES),
        "nbytes": st.one_of(st.sampled_from([0, 1, 8, 24, 96, 192]), _SIZES),
    }
)
_HEADER = st.fixed_dictionaries(
    {
        "metadata": st.one_of(
            st.just({"num_batches": 2}),
            st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3),
            st.lists(st.integers(), max_size=2),
        ),
        "tensors": st.one_of(st.lists(_ENTRY, max_size=3), st.integers()),
        "data_bytes": st.one_of(st.sampled_from([0, 96, 192, 256]), _SIZES),
    },
    optional={"extras": st.lists(_ENTRY, max_size=2)},
)


@_FUZZ
@given(header=_HEADER, data_len=st.sampled_from([0, 96, 192, 256, 300]))
def test_fuzzed_headers_load_or_are_corrupt(
    tmp_path: Path, header: dict[str, Any], data_len: int
) -> None:
    """Any header (its sizes, offsets, dtypes and shapes drawn at random, valid or not) over
    data of any length: a file that loads has every tensor inside its data."""
    text = json.dumps(header, sort_keys=True).encode()  # NaN and Infinity too, as Python writes
    data = bytes(i * 7 % 256 for i in range(data_len))
    _loads_or_is_corrupt(tmp_path, _pack(None, data, text=text))


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.sampled_from(["x", "y", "int64", "window"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["name", "dtype", "shape", "role", "storage", "kind", "source", "offset"]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@_FUZZ
@given(schema=_JSON)
def test_fuzzed_schemas_load_or_are_corrupt(tmp_path: Path, schema: Any) -> None:
    """A file's own schema is checked against what it stores: any schema at all gives a
    loaded file or CorruptBatchFile."""
    data = _edit("metadata.batch_size", 3, "metadata.schema", schema)
    _loads_or_is_corrupt(tmp_path, data)
