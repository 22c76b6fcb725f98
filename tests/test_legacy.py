"""LegacyClient: nanoGPT-style {split}_batches_*.pt files read in order, sliced and cycled."""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path

import pytest
import torch

from queue_client.errors import CorruptBatchFile, MetaError, UnknownSplit
from queue_client.format.meta import dump_meta
from queue_client.legacy import LegacyClient

N, T = 10, 3


class _TouchOnUnpickle:
    """Unpickling this runs Path.touch(marker): a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _write_file(path: Path, first_row: int, n: int = N) -> None:
    """Row i of x is [first_row + i] * T, so a batch's rows say where they came from."""
    rows = torch.arange(first_row, first_row + n, dtype=torch.int64)
    x = rows[:, None].expand(n, T).contiguous()
    torch.save({"x": x, "y": x + 1}, path)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    _write_file(tmp_path / "train_batches_000.pt", 0)
    _write_file(tmp_path / "train_batches_001.pt", 100)
    _write_file(tmp_path / "val_batches_000.pt", 500, n=3)
    return tmp_path


def _rows(x: torch.Tensor) -> list[int]:
    return x[:, 0].tolist()


def test_batches_are_contiguous_slices_with_repeat_to_fill(data_dir: Path) -> None:
    """Batches are 0-3, 4-7, then 8,9,0,1 (filled from the file's start), then the next file."""
    client = LegacyClient(data_dir, batch_size=4)
    seen = []
    for _ in range(7):
        x, y = client.get_batch("train")
        assert x.shape == y.shape == (4, T)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)
        seen.append(_rows(x))
    assert seen == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
        [100, 101, 102, 103],
        [104, 105, 106, 107],
        [108, 109, 100, 101],
        [0, 1, 2, 3],  # the files cycle
    ]


def test_exact_multiple_has_no_fill(tmp_path: Path) -> None:
    """When batch_size divides the file, each sample appears once per pass."""
    _write_file(tmp_path / "train_batches_000.pt", 0)
    client = LegacyClient(tmp_path, batch_size=5)
    assert [_rows(client.get_batch("train")[0]) for _ in range(3)] == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
        [0, 1, 2, 3, 4],
    ]


def test_batch_larger_than_file_wraps(data_dir: Path) -> None:
    """A batch bigger than a file repeats that file's samples in order."""
    client = LegacyClient(data_dir, batch_size=4)
    assert _rows(client.get_batch("val")[0]) == [500, 501, 502, 500]


def test_splits_are_independent(data_dir: Path) -> None:
    """Reading one split does not advance another."""
    client = LegacyClient(data_dir, batch_size=2)
    assert _rows(client.get_batch("train")[0]) == [0, 1]
    assert _rows(client.get_batch("val")[0]) == [500, 501]
    assert _rows(client.get_batch("train")[0]) == [2, 3]


def test_meta_batch_size_is_used(data_dir: Path) -> None:
    """Without batch_size, meta.pkl's batch_size is used; an explicit value wins."""
    dump_meta(data_dir / "meta.pkl", {"batch_size": 3, "vocab_size": 65})
    client = LegacyClient(data_dir)
    assert client.batch_size == 3
    assert client.meta["vocab_size"] == 65
    assert _rows(client.get_batch("train")[0]) == [0, 1, 2]
    assert LegacyClient(data_dir, batch_size=2).batch_size == 2


def test_missing_batch_size_is_meta_error(data_dir: Path) -> None:
    """No batch_size argument and no meta.pkl raises MetaError saying what is needed."""
    with pytest.raises(MetaError, match="batch_size"):
        LegacyClient(data_dir)


@pytest.mark.parametrize("bad", [0, -1, "4", None])
def test_bad_meta_batch_size_is_meta_error(data_dir: Path, bad: object) -> None:
    """A meta.pkl batch_size that is not a positive int raises MetaError."""
    dump_meta(data_dir / "meta.pkl", {"batch_size": bad})
    with pytest.raises(MetaError, match="batch_size"):
        LegacyClient(data_dir)


def test_missing_data_dir_is_meta_error(tmp_path: Path) -> None:
    """A data dir that does not exist raises MetaError naming it."""
    with pytest.raises(MetaError, match="does not exist"):
        LegacyClient(tmp_path / "absent", batch_size=2)


def test_no_files_for_split_is_unknown_split(data_dir: Path) -> None:
    """A split with no files raises UnknownSplit naming the pattern."""
    client = LegacyClient(data_dir, batch_size=2)
    with pytest.raises(UnknownSplit, match="test_batches_"):
        client.get_batch("test")


def test_crafted_pickle_is_refused_without_running_code(tmp_path: Path) -> None:
    """A batch file whose unpickling would run code raises CorruptBatchFile; nothing runs."""
    marker = tmp_path / "pwned"
    path = tmp_path / "train_batches_000.pt"
    torch.save({"x": _TouchOnUnpickle(marker), "y": torch.zeros(2, 2)}, path)
    client = LegacyClient(tmp_path, batch_size=2)
    with pytest.raises(CorruptBatchFile) as info:
        client.get_batch("train")
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_crafted_meta_pickle_is_refused(tmp_path: Path) -> None:
    """A meta.pkl that would run code is refused (MetaError) without running it."""
    marker = tmp_path / "pwned"
    (tmp_path / "meta.pkl").write_bytes(
        pickle.dumps({"batch_size": 2, "x": _TouchOnUnpickle(marker)})
    )
    with pytest.raises(MetaError):
        LegacyClient(tmp_path, batch_size=2)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        {"x": torch.zeros(4, 2, dtype=torch.int64)},
        {"x": torch.zeros(4, 2), "y": torch.zeros(3, 2)},
        {"x": torch.zeros(0, 2), "y": torch.zeros(0, 2)},
        [torch.zeros(2, 2)],
    ],
    ids=["no-y", "length-mismatch", "empty", "not-a-dict"],
)
def test_malformed_files_are_corrupt(tmp_path: Path, payload: object) -> None:
    """Files without matching non-empty x and y raise CorruptBatchFile naming the file."""
    path = tmp_path / "train_batches_000.pt"
    torch.save(payload, path)
    with pytest.raises(CorruptBatchFile) as info:
        LegacyClient(tmp_path, batch_size=2).get_batch("train")
    assert str(path) in str(info.value)


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    """A truncated file raises CorruptBatchFile naming the file."""
    path = tmp_path / "train_batches_000.pt"
    _write_file(path, 0)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptBatchFile) as info:
        LegacyClient(tmp_path, batch_size=2).get_batch("train")
    assert str(path) in str(info.value)


def test_non_tensor_fields_are_corrupt(tmp_path: Path) -> None:
    """A weights-only-loadable file whose x and y are lists is corrupt, not a crash."""
    torch.save({"x": [[1, 2]], "y": [[2, 3]]}, tmp_path / "train_batches_000.pt")
    with pytest.raises(CorruptBatchFile):
        LegacyClient(tmp_path, batch_size=1).get_batch("train")


def test_tensors_nested_under_tensors_key(tmp_path: Path) -> None:
    """A batchqueue-style payload with a 'tensors' dict is read too."""
    x = torch.arange(6, dtype=torch.int64).view(3, 2)
    torch.save({"tensors": {"x": x, "y": x + 1}}, tmp_path / "train_batches_000.pt")
    bx, by = LegacyClient(tmp_path, batch_size=2).get_batch("train")
    assert torch.equal(bx, x[:2])
    assert torch.equal(by, x[:2] + 1)
