"""Batch file format version 3 (FORMAT.md): the exact bytes, round trips of every dtype,
determinism, copy-on-write loading, versions 1 and 2 beside it, and malformed files (hand-made
and fuzzed), each refused with CorruptBatchFile naming the file and never anything else."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_client import batchfile_v3 as v3
from queue_client.batchfile import (
    FORMAT_VERSION,
    encode_batch_file,
    load_batch_bytes,
    load_batch_file,
    publish_batch_file,
)
from queue_client.errors import CorruptBatchFile
from queue_client.schema import DTYPES, torch_dtype

NAME = "1700000000123-0000000004-2.pt"


def _values(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Values spanning the dtype's range where it has one (so byte order matters)."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return (torch.arange(n) % 3 == 0).view(shape)
    t = torch.arange(n, dtype=torch.float64) * 37.5 - 100
    if not torch_dtype(dtype).is_floating_point:
        info = torch.iinfo(torch_dtype(dtype))
        t = torch.linspace(info.min, info.max, n, dtype=torch.float64).floor()
    return t.to(torch_dtype(dtype)).view(shape)


def _all_dtypes() -> dict[str, torch.Tensor]:
    return {f"t_{d}": _values(d, (2, 3, 5)) for d in DTYPES}


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / NAME
    path.write_bytes(data)
    return path


def _both(tmp_path: Path, data: bytes) -> list[Any]:
    """The file loaded from disk (mapped) and from bytes (streamed)."""
    return [load_batch_file(_file(tmp_path, data)), load_batch_bytes(data, NAME)]


# ---- the bytes ----------------------------------------------------------------------------


def test_the_bytes_are_those_format_md_describes() -> None:
    """Prefix (magic, version 3, reserved 0, header length; little-endian), the JSON header
    with sorted keys and no spaces, zero padding to 64, then the tensor bytes little-endian."""
    t = torch.tensor([[[1, 258]]], dtype=torch.uint16)
    encoded = encode_batch_file(seq=1, tensors={"t": t}, metadata={"b": 1, "a": (1, 2)})
    header = (
        b'{"data_bytes":4,"extras":[],"metadata":{"a":[1,2],"b":1,"num_batches":1,"seq":1},'
        b'"tensors":[{"dtype":"uint16","name":"t","nbytes":4,"offset":0,"shape":[1,1,2]}]}'
    )
    prefix = b"BQBATCH\x00" + (3).to_bytes(4, "little") + bytes(4)
    prefix += len(header).to_bytes(8, "little")
    start = -(-(24 + len(header)) // 64) * 64
    want = prefix + header + bytes(start - 24 - len(header)) + b"\x01\x00\x02\x01"
    assert encoded.data == want
    assert encoded.crc32 == zlib.crc32(want)


def test_every_dtype_round_trips_aligned_from_a_file_and_from_bytes(tmp_path: Path) -> None:
    """Every schema dtype (bool, uint8 ... int64, float16, bfloat16, float32, float64) loads
    back with its dtype, shape and values, at a 64-byte aligned offset of the file."""
    tensors = _all_dtypes()
    encoded = encode_batch_file(seq=4, tensors=tensors, metadata={"split": "train"})
    for loaded in _both(tmp_path, encoded.data):
        assert loaded.version == FORMAT_VERSION == 3
        assert list(loaded.stored) == list(tensors)  # the writer's order
        for name, want in tensors.items():
            got = loaded.stored[name]
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert torch.equal(got, want), name
            assert got.data_ptr() % 16 == 0, name
    layout = v3.parse(encoded.data, NAME, FORMAT_VERSION)
    assert layout.data_start % 64 == 0
    assert all(e.offset % 64 == 0 for e in layout.tensors)


def test_extras_of_any_shape_round_trip(tmp_path: Path) -> None:
    """extras (a candidate's CSR histograms; any shape, empty and 0-d included) come back
    beside the batches, and are not batches."""
    extras = {
        "token_hist_offsets": torch.tensor([0, 3, 3], dtype=torch.int64),
        "token_hist_ids": torch.tensor([1, 5, 9], dtype=torch.int32),
        "token_hist_counts": torch.tensor([4, 1, 2], dtype=torch.int32),
        "nothing": torch.empty(0, 7, dtype=torch.float32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    tensors = {"x": _values("int64", (2, 3, 4)), "empty": torch.empty(2, 3, 0, dtype=torch.int32)}
    encoded = encode_batch_file(seq=4, tensors=tensors, metadata={}, extras=extras)
    for loaded in _both(tmp_path, encoded.data):
        assert set(loaded.stored) == set(tensors) and set(loaded.extras) == set(extras)
        for name, want in {**tensors, **extras}.items():
            got = {**loaded.stored, **loaded.extras}[name]
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_the_same_arguments_give_the_same_bytes() -> None:
    """Key order, tuples against lists, shared against separate objects and a non-contiguous
    tensor against its contiguous copy make no difference to the bytes."""
    x = _values("int32", (2, 4, 3))
    one = encode_batch_file(
        seq=9, tensors={"x": x.transpose(1, 2).contiguous().transpose(1, 2)},
        metadata={"b": [1, 2], "a": {"z": 1, "y": "s"}},
    )  # fmt: skip
    two = encode_batch_file(
        seq=9, tensors={"x": x.clone()}, metadata={"a": {"y": "".join("s"), "z": 1}, "b": (1, 2)}
    )
    assert one.data == two.data and one.crc32 == two.crc32


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ({"n": np.int64(3)}, r"metadata\['n'\] is a numpy.int64"),
        ({"schema": [{"shape": [torch.tensor(1)]}]}, r"metadata\['schema'\]\[0\]\['shape'\]\[0\]"),
        ({"a": {1: "x"}}, r"metadata\['a'\] has key 1 \(int\)"),
        ({"f": float("nan")}, "finite"),
        ({"b": b"raw"}, r"metadata\['b'\] is a builtins.bytes"),
        ({"s": {1, 2}}, "builtins.set"),
    ],
)
def test_metadata_json_cannot_hold_is_refused_naming_it(metadata: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        encode_batch_file(seq=0, tensors={"x": torch.zeros(1, 1)}, metadata=metadata)


# ---- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 3])
def test_writing_into_a_loaded_tensor_changes_no_file(tmp_path: Path, version: int) -> None:
    """Mapped copy-on-write (and private copies of streamed bytes): a trainer writing into a
    batch changes neither the file, nor the bytes it was loaded from, nor a fresh load."""
    tensors = {"x": _values("int64", (2, 3, 4))}
    encoded = encode_batch_file(seq=2, tensors=tensors, metadata={}, version=version)
    published = publish_batch_file(tmp_path, encoded)
    path = tmp_path / str(published.name)
    data = bytes(encoded.data)
    for loaded in (load_batch_file(path), load_batch_bytes(data, "streamed")):
        assert loaded.version == version
        loaded.stored["x"].fill_(-5)
    assert path.read_bytes() == data == encoded.data
    assert torch.equal(load_batch_file(path).stored["x"], tensors["x"])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_a_version_3_file_is_mapped_privately_not_read(tmp_path: Path) -> None:
    path = _file(tmp_path, encode_batch_file(seq=4, tensors=_all_dtypes(), metadata={}).data)
    loaded = load_batch_file(path)
    maps = [ln for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith(str(path))]
    assert maps and all(ln.split()[1] == "rw-p" for ln in maps), maps
    del loaded


@pytest.mark.parametrize("version", [1, 2])
def test_versions_1_and_2_still_encode_as_torch_zips_and_load(tmp_path: Path, version: int) -> None:
    """A dataset dir built with them keeps writing them: torch.save zips, as before."""
    tensors = {"x": _values("uint16", (2, 3, 4))}
    hist = {"h": torch.arange(3)}
    encoded = encode_batch_file(
        seq=4, tensors=tensors, metadata={"a": 1}, extras=hist, version=version
    )
    assert encoded.data[:2] == b"PK"
    assert encoded == encode_batch_file(
        seq=4, tensors=tensors, metadata={"a": 1}, extras=hist, version=version
    )
    for loaded in _both(tmp_path, encoded.data):
        assert loaded.version == version and loaded.metadata["a"] == 1
        assert torch.equal(loaded.stored["x"], tensors["x"])
        assert torch.equal(loaded.extras["h"], hist["h"])


def test_an_unknown_version_is_not_written() -> None:
    with pytest.raises(ValueError, match="version 4 is not one of"):
        encode_batch_file(seq=0, tensors={"x": torch.zeros(1, 1)}, metadata={}, version=4)


# ---- malformed files ----------------------------------------------------------------------


def _good() -> bytes:
    return encode_batch_file(
        seq=4, tensors={"x": _values("int32", (2, 3, 4)), "y": _values("uint8", (2, 3, 4))},
        metadata={"split": "train"},
    ).data  # fmt: skip


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
