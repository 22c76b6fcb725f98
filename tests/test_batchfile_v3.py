"""Batch file format version 3 (FORMAT.md): the exact bytes, round trips of every dtype,
determinism, copy-on-write loading, and versions 1 and 2 beside it. Malformed files are
test_batchfile_v3_corrupt.py's."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from queue_client.format import batchfile_v3 as v3
from queue_client.format.batchfile import (
    FORMAT_VERSION,
    encode_batch_file,
    load_batch_bytes,
    load_batch_file,
    publish_batch_file,
)
from queue_client.format.schema import DTYPES, torch_dtype

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
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    shared = "s"
    one = encode_batch_file(
        seq=9, tensors={"x": strided}, metadata={"b": [1, 2], "a": {"z": 1, "y": shared}}
    )
    two = encode_batch_file(
        seq=9, tensors={"x": x.clone()}, metadata={"a": {"y": "".join(["s"]), "z": 1}, "b": (1, 2)}
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


def test_a_torch_zip_file_deleted_while_it_is_loaded_is_not_found_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that listed a queue dir while a client's release deleted a file: torch opens
    the zip first and maps it by its name after, so a file deleted between the two gives
    torch's RuntimeError. That is a missing file, not a corrupt one."""
    from queue_client.format import batchfile_torch

    encoded = encode_batch_file(seq=1, tensors={"x": torch.zeros(2, 3)}, metadata={}, version=1)
    path = tmp_path / "0000000001-0000000001-2.pt"
    path.write_bytes(encoded.data)
    from_file = torch.UntypedStorage.from_file

    def deleted_first(name: str, *args: Any, **kwargs: Any) -> Any:
        Path(name).unlink()  # the release's delete, between torch's open and its map
        return from_file(name, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", deleted_first)
    with pytest.raises(FileNotFoundError):
        batchfile_torch.load_path(path)


def test_an_unknown_version_is_not_written() -> None:
    with pytest.raises(ValueError, match="version 4 is not one of"):
        encode_batch_file(seq=0, tensors={"x": torch.zeros(1, 1)}, metadata={}, version=4)


def test_numpy_arrays_encode_as_the_same_tensors_do(tmp_path: Path) -> None:
    """A writer that never imports torch (char_lm's workers) hands numpy arrays in: each dtype
    numpy has gives the bytes its tensor gives, views included; the file loads as tensors."""
    tensors = {k: t for k, t in _all_dtypes().items() if k != "t_bfloat16"}
    window = torch.arange(2 * 3 * 9, dtype=torch.int32).view(2, 3, 9)
    tensors["view"] = window[..., 1:]  # not contiguous
    extras = {"h": torch.arange(7, dtype=torch.int64)}
    arrays = {k: t.numpy() for k, t in tensors.items()}
    meta = {"a": 1}
    want = encode_batch_file(seq=3, tensors=tensors, metadata=meta, extras=extras)
    got = encode_batch_file(seq=3, tensors=arrays, metadata=meta, extras={"h": extras["h"].numpy()})
    assert got == want
    for version in (1, 2):  # torch.save zips: the arrays become tensors first
        assert encode_batch_file(seq=3, tensors=arrays, metadata=meta, version=version) == (
            encode_batch_file(seq=3, tensors=tensors, metadata=meta, version=version)
        )
    loaded = load_batch_file(_file(tmp_path, got.data))
    assert torch.equal(loaded.stored["view"], tensors["view"])


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (np.zeros((1, 2), dtype=np.complex64), "dtype complex64"),
        (np.array([["a"]], dtype=object), "dtype object"),
        ([[1, 2]], "is not a tensor"),
    ],
)
def test_an_array_the_format_cannot_hold_is_refused_naming_it(value: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=rf"tensors .*'x'.*{needle}|{needle}"):
        encode_batch_file(seq=0, tensors={"x": value}, metadata={})
