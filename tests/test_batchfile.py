"""The on-disk batch file format: names, encoding, atomic publishing, safe copy-on-write
loading. Directory names and name checks are layout's (test_layout.py)."""

from __future__ import annotations

import os
import pathlib
import pickle
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_client.errors import CorruptBatchFile
from queue_client.format import batchfile as bf
from queue_client.format import checksum
from queue_client.format.batchfile import (
    BatchFileName,
    encode_batch_file,
    file_crc32,
    load_batch_file,
    publish_batch_file,
    scan_queue,
    write_batch_file,
)
from queue_client.format.layout import DatasetLayout, is_temp_name, remove_temp_files, temp_path


def _tensors(num_batches: int = 3, batch_size: int = 2, width: int = 5) -> dict[str, torch.Tensor]:
    n = num_batches * batch_size * width
    x = torch.arange(n, dtype=torch.int64).view(num_batches, batch_size, width)
    return {"x": x, "y": (x + 1).to(torch.int32)}


def _publish(directory: Path, seq: int = 7, **kw: int) -> tuple[bf.PublishedFile, Path]:
    published = write_batch_file(
        directory, seq=seq, tensors=_tensors(**kw), metadata={"split": "train"}
    )
    return published, directory / str(published.name)


class _TouchOnUnpickle:
    """Unpickling this runs Path.touch(marker): a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


# ---- names --------------------------------------------------------------------------------


def test_name_str_parse_round_trip() -> None:
    """str() pads timestamp and seq to fixed width, and parse() reads it back exactly."""
    name = BatchFileName(1_700_000_000_123, 42, 100)
    assert str(name) == "1700000000123-0000000042-100.pt"
    assert BatchFileName.parse(str(name)) == name


@settings(max_examples=100, deadline=None)
@given(
    ts=st.integers(0, 10**13 - 1),
    seq=st.integers(0, 10**10 - 1),
    nb=st.integers(0, 10**6),
)
def test_name_round_trip_property(ts: int, seq: int, nb: int) -> None:
    """Every name the writer can produce parses back to the same value."""
    name = BatchFileName(ts, seq, nb)
    assert BatchFileName.parse(str(name)) == name


def test_names_order_by_timestamp_then_seq() -> None:
    """Sorting BatchFileName values orders by timestamp first, then seq, like sorted file names."""
    names = [
        BatchFileName(2000, 1, 5),
        BatchFileName(1000, 9, 5),
        BatchFileName(1000, 2, 5),
        BatchFileName(3000, 0, 5),
    ]
    ordered = sorted(names)
    assert [(n.timestamp_ms, n.seq) for n in ordered] == [
        (1000, 2),
        (1000, 9),
        (2000, 1),
        (3000, 0),
    ]
    assert [str(n) for n in ordered] == sorted(str(n) for n in names)


@pytest.mark.parametrize(
    "name",
    [
        ".tmp-4242-0-1700000000123-0000000042-100.pt",
        ".tmp-1700000000123-0000000042-123.pt",  # the temp name before layout.temp_path
        ".tmp-1700000000123-0000000042-100.pt",
        "meta.pkl",
        "foo.pt",
        "1700000000123-0000000042-100.pt.reason.txt",
        "1700000000123-42-100.pt",  # seq not padded
        "170000000012-0000000042-100.pt",  # 12-digit timestamp
        "1700000000123-0000000042-100.pth",
        "1700000000123-0000000042-.pt",
        "x1700000000123-0000000042-100.pt",
        "",
    ],
)
def test_parse_rejects_temp_and_foreign_names(name: str) -> None:
    """Temp files and anything not named like a published batch file parse to None."""
    assert BatchFileName.parse(name) is None


def test_parse_rejects_trailing_newline() -> None:
    """A name with a trailing newline is not a published batch file."""
    assert BatchFileName.parse("1700000000123-0000000042-100.pt\n") is None


# ---- publishing ---------------------------------------------------------------------------


def test_write_publishes_atomically_with_matching_size_and_crc(tmp_path: Path) -> None:
    """The final name exists, no temp is left, and size/crc32 describe the bytes on disk."""
    published, path = _publish(tmp_path, seq=7)
    assert path.is_file()
    assert published.name.seq == 7
    assert published.name.num_batches == 3
    assert sorted(os.listdir(tmp_path)) == [str(published.name)]
    data = path.read_bytes()
    assert published.size_bytes == len(data)
    assert published.crc32 == zlib.crc32(data)
    assert file_crc32(path) == published.crc32


def test_encode_is_deterministic_and_writes_nothing(tmp_path: Path) -> None:
    """The same arguments give the same bytes, wherever they are encoded; nothing touches disk
    until publish, which writes exactly those bytes under the published name."""
    one = encode_batch_file(seq=3, tensors=_tensors(), metadata={"split": "train"})
    two = encode_batch_file(seq=3, tensors=_tensors(), metadata={"split": "train"})
    assert one == two
    assert (one.seq, one.num_batches, one.crc32) == (3, 3, zlib.crc32(one.data))
    assert os.listdir(tmp_path) == []
    published = publish_batch_file(tmp_path, one)
    assert os.listdir(tmp_path) == [str(published.name)]
    assert (tmp_path / str(published.name)).read_bytes() == one.data
    assert (published.name.seq, published.name.num_batches) == (3, 3)
    assert (published.size_bytes, published.crc32) == (len(one.data), one.crc32)


def test_encoded_bytes_load_back(tmp_path: Path) -> None:
    """What encode makes, load reads, extras included."""
    hist = torch.arange(4, dtype=torch.int64)
    encoded = encode_batch_file(seq=5, tensors=_tensors(), metadata={}, extras={"h": hist})
    published = publish_batch_file(tmp_path, encoded)
    loaded = load_batch_file(tmp_path / str(published.name))
    assert torch.equal(loaded.tensors["x"], _tensors()["x"])
    assert torch.equal(loaded.extras["h"], hist)
    assert loaded.metadata["seq"] == 5


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=70_000), start=st.integers(0, 2**32 - 1))
def test_the_checksum_is_zlibs_crc32(data: bytes, start: int) -> None:
    """Files are hashed by zlib-ng where it is installed (it is a dependency): the values are
    zlib's, so files written or checked by either agree, also hashed in pieces."""
    assert checksum.IMPLEMENTATION == "zlib_ng.zlib_ng"
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)
    cut = len(data) // 3
    assert checksum.crc32(data[cut:], checksum.crc32(data[:cut])) == zlib.crc32(data)


def test_without_zlib_ng_the_checksum_is_zlibs_own() -> None:
    """Where zlib-ng cannot be installed the same values come from zlib (a fresh interpreter
    in which importing zlib_ng fails)."""
    import subprocess
    import sys

    code = (
        "import sys, zlib; sys.modules['zlib_ng'] = None\n"
        "from queue_client.format import checksum\n"
        "assert checksum.IMPLEMENTATION == 'zlib', checksum.IMPLEMENTATION\n"
        "assert checksum.crc32(b'batchqueue', 7) == zlib.crc32(b'batchqueue', 7)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _mapped_kib(path: Path) -> int:
    """The resident KiB of this process's map of `path` (its page-table entries)."""
    found, rss = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header line
            found = line.endswith(str(path))
        elif found and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


def test_a_checked_load_hashes_its_own_map_and_refuses_other_bytes(tmp_path: Path) -> None:
    """With the server's crc32 the file is hashed through the map its tensors view, so every
    page is mapped once it loads (the client skips its own page touching then); a crc32 that
    differs raises CorruptBatchFile naming the file and both values."""
    big = {"x": torch.arange(3 * 2 * 50_000, dtype=torch.int64).view(3, 2, 50_000)}
    published = write_batch_file(tmp_path, seq=1, tensors=big, metadata={})
    path = tmp_path / str(published.name)
    loaded = load_batch_file(path, crc32=published.crc32)
    assert torch.equal(loaded.tensors["x"], big["x"])
    if Path("/proc/self/smaps").exists():  # (an unchecked map may be resident as well:
        # the kernel maps a large folio of the page cache whole on one fault)
        assert _mapped_kib(path) * 1024 >= published.size_bytes - 4096
    wrong = published.crc32 ^ 1
    with pytest.raises(CorruptBatchFile, match=rf"{published.name} has crc32 .*{wrong:#010x}"):
        load_batch_file(path, crc32=wrong)


def test_publish_into_a_missing_directory_names_it(tmp_path: Path) -> None:
    """Publishing never creates directories: the queue dir is the server's to make."""
    encoded = encode_batch_file(seq=0, tensors=_tensors(), metadata={})
    with pytest.raises(FileNotFoundError, match="absent"):
        publish_batch_file(tmp_path / "absent", encoded)


def test_file_crc32_of_empty_file_is_zero(tmp_path: Path) -> None:
    """An empty file hashes to crc32(b"") without trying to map zero bytes."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_crc32(empty) == zlib.crc32(b"") == 0


def test_write_rejects_empty_tensors(tmp_path: Path) -> None:
    """A file needs at least one tensor; nothing is written otherwise."""
    with pytest.raises(ValueError, match="at least one tensor"):
        write_batch_file(tmp_path, seq=0, tensors={}, metadata={})
    assert os.listdir(tmp_path) == []


def test_failed_rename_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If publishing fails at the rename, the temp file is removed and the error propagates."""

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_batch_file(tmp_path, seq=1, tensors=_tensors(), metadata={})
    assert os.listdir(tmp_path) == []


def test_scan_queue_ignores_temp_and_foreign_files_and_sorts(tmp_path: Path) -> None:
    """scan_queue lists only published names, in (timestamp, seq) order."""
    names = [BatchFileName(3000, 1, 2), BatchFileName(1000, 5, 2), BatchFileName(1000, 3, 2)]
    for n in names:
        (tmp_path / str(n)).write_bytes(b"")
    temp_path(tmp_path / str(BatchFileName(500, 0, 2))).write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    (tmp_path / "0000000000900-0000000001-2.pt.reason.txt").write_bytes(b"")
    assert scan_queue(tmp_path) == sorted(names)
    assert [(n.timestamp_ms, n.seq) for n in scan_queue(tmp_path)] == [
        (1000, 3),
        (1000, 5),
        (3000, 1),
    ]


def test_scan_queue_of_missing_directory_is_empty(tmp_path: Path) -> None:
    """A queue directory that does not exist yet holds no files."""
    assert scan_queue(tmp_path / "absent") == []


def test_an_interrupted_publish_leaves_only_a_temp_name(tmp_path: Path) -> None:
    """A temp file beside published ones is invisible to scan_queue and removed at start."""
    _, published = _publish(tmp_path)
    leftover = temp_path(tmp_path / str(BatchFileName(1, 8, 3)))
    leftover.write_bytes(b"half a file")
    assert is_temp_name(leftover.name)
    assert [str(n) for n in scan_queue(tmp_path)] == [published.name]
    assert remove_temp_files(tmp_path) == 1
    assert os.listdir(tmp_path) == [published.name]


def test_the_dir_functions_kept_for_old_importers_give_the_layout_paths() -> None:
    """batchfile.dataset_dir/queue_dir/quarantine_dir delegate to DatasetLayout."""
    layout = DatasetLayout(Path("r"), "ds")
    assert bf.dataset_dir(Path("r"), "ds") == layout.dir
    assert bf.queue_dir(Path("r"), "ds", "train") == layout.queue_dir("train")
    assert bf.quarantine_dir(Path("r"), "ds", "val") == layout.quarantine_dir("val")


def test_remove_temp_files_removes_only_temp_files(tmp_path: Path) -> None:
    """Only .tmp-* entries are deleted, and the count of deleted files is returned."""
    _, published = _publish(tmp_path)
    (tmp_path / ".tmp-a.pt").write_bytes(b"partial")
    (tmp_path / ".tmp-b").write_bytes(b"partial")
    (tmp_path / "keep.txt").write_bytes(b"x")
    (tmp_path / "tmp-not-hidden.pt").write_bytes(b"x")
    assert remove_temp_files(tmp_path) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([published.name, "keep.txt", "tmp-not-hidden.pt"])
    assert remove_temp_files(tmp_path) == 0


# ---- loading ------------------------------------------------------------------------------


def test_load_returns_tensors_and_metadata(tmp_path: Path) -> None:
    """Loaded tensors equal the written ones, [num_batches, batch_size, ...], with metadata."""
    _, path = _publish(tmp_path, seq=11, num_batches=4, batch_size=3, width=6)
    loaded = load_batch_file(path)
    expected = _tensors(num_batches=4, batch_size=3, width=6)
    assert set(loaded.tensors) == {"x", "y"}
    for key, want in expected.items():
        got = loaded.tensors[key]
        assert got.shape == (4, 3, 6)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert loaded.metadata["seq"] == 11
    assert loaded.metadata["num_batches"] == 4
    assert loaded.metadata["split"] == "train"


def test_loaded_tensors_are_copy_on_write(tmp_path: Path) -> None:
    """Writing into a loaded tensor changes neither the file on disk nor a fresh load."""
    _, path = _publish(tmp_path)
    before = path.read_bytes()
    loaded = load_batch_file(path)
    loaded.tensors["x"].fill_(-1)
    loaded.tensors["y"].add_(1000)
    assert path.read_bytes() == before
    again = load_batch_file(path)
    assert torch.equal(again.tensors["x"], _tensors()["x"])
    assert torch.equal(again.tensors["y"], _tensors()["y"])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_load_memory_maps_the_file_privately(tmp_path: Path) -> None:
    """The file is mapped (not read into a copy), and the mapping is private (copy-on-write)."""
    _, path = _publish(tmp_path)
    loaded = load_batch_file(path)
    maps = [
        line
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(str(path))
    ]
    assert maps, "the batch file is not memory-mapped"
    assert all(line.split()[1].endswith("p") for line in maps), maps
    del loaded


@pytest.mark.parametrize("packaging", ["torch_zip", "raw_pickle"])
def test_load_refuses_malicious_pickle_without_running_it(tmp_path: Path, packaging: str) -> None:
    """A pickle that would run code on load raises CorruptBatchFile and runs nothing."""
    marker = tmp_path / "pwned"
    path = tmp_path / "1700000000123-0000000001-1.pt"
    payload = {"format": bf.FORMAT_NAME, "version": 1, "evil": _TouchOnUnpickle(marker)}
    if packaging == "torch_zip":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(CorruptBatchFile, match=str(path)):
        load_batch_file(path)
    assert not marker.exists()


def test_malicious_pickle_is_live(tmp_path: Path) -> None:
    """Control: the crafted payload really does run code when loaded unsafely."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"evil": _TouchOnUnpickle(marker)}, path)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("cut", ["empty", "10 bytes", "100 bytes", "half", "all but 10"])
def test_truncated_file_raises_corrupt_naming_path(tmp_path: Path, cut: str) -> None:
    """A file cut short anywhere raises CorruptBatchFile whose message names the file."""
    _, good = _publish(tmp_path)
    data = good.read_bytes()
    keep = {"empty": 0, "10 bytes": 10, "100 bytes": 100, "half": len(data) // 2}.get(
        cut, len(data) - 10
    )
    bad = tmp_path / "1700000000123-0000000099-3.pt"
    bad.write_bytes(data[:keep])
    with pytest.raises(CorruptBatchFile) as info:
        load_batch_file(bad)
    assert str(bad) in str(info.value)


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    """A file that vanished is not 'corrupt': FileNotFoundError passes through."""
    with pytest.raises(FileNotFoundError):
        load_batch_file(tmp_path / "1700000000123-0000000001-1.pt")


def test_newer_version_is_refused_with_upgrade_hint(tmp_path: Path) -> None:
    """A file from a newer writer is refused with a message telling the user to upgrade."""
    path = tmp_path / "1700000000123-0000000001-1.pt"
    torch.save(
        {
            "format": bf.FORMAT_NAME,
            "version": bf.FORMAT_VERSION + 1,
            "metadata": {"num_batches": 1},
            "tensors": {"x": torch.zeros(1, 2, 3)},
        },
        path,
    )
    with pytest.raises(CorruptBatchFile, match="upgrade") as info:
        load_batch_file(path)
    assert str(path) in str(info.value)
    assert str(bf.FORMAT_VERSION + 1) in str(info.value)


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"format": "something.else", "version": 1}, "not a batchqueue.batchfile"),
        ([1, 2, 3], "not a batchqueue.batchfile"),
        ({"format": bf.FORMAT_NAME, "version": "1"}, "newer"),
        ({"format": bf.FORMAT_NAME, "version": 1, "metadata": {}, "tensors": {}}, "missing"),
        (
            {
                "format": bf.FORMAT_NAME,
                "version": 1,
                "metadata": {"num_batches": 2},
                "tensors": {"x": torch.zeros(3, 2, 4)},
            },
            "'x'",
        ),
        (
            {
                "format": bf.FORMAT_NAME,
                "version": 1,
                "metadata": {"num_batches": 2},
                "tensors": {"x": torch.zeros(2)},
            },
            "'x'",
        ),
    ],
)
def test_malformed_payloads_are_corrupt(tmp_path: Path, payload: object, needle: str) -> None:
    """Loadable files that don't follow the format raise CorruptBatchFile saying why."""
    path = tmp_path / "1700000000123-0000000001-1.pt"
    torch.save(payload, path)
    with pytest.raises(CorruptBatchFile, match=needle):
        load_batch_file(path)


def test_equal_metadata_encodes_to_equal_bytes_however_it_was_built() -> None:
    """A file is a function of its contents: metadata whose strings are one shared object
    (a schema parsed once) and metadata with equal but separate strings (parsed again in
    another process) give the same bytes, so a seq made anywhere is the same file."""
    tensors = {"x": torch.arange(12).reshape(3, 4)}
    source = "tokens"
    shared = {"schema": [{"source": source}, {"source": source}]}
    separate = {
        "schema": [{"source": "".join(["tok", "ens"])}, {"source": "".join(["to", "kens"])}]
    }
    a = encode_batch_file(seq=0, tensors=tensors, metadata=shared)
    b = encode_batch_file(seq=0, tensors=tensors, metadata=separate)
    assert a.data == b.data
