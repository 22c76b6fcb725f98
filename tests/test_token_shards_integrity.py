"""token_shards refuses index files that lie: document starts that are unsorted, negative or
past the shard's end (a prepared .docs.npy, a Megatron .idx's pointers and document index),
each named by file, entry and value before a token is served twice; a prepared shard that is
a symlink out of its folder; and it reads .npy headers of any length numpy writes."""

from __future__ import annotations

import re
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from support.failing_datasets import errors_of_failed
from support.token_files import write_prepared

from conftest import subprocess_env
from queue_client.errors import ConfigError
from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create

T = 8


def provider(tmp_path: Path, args: dict):
    ctx = ProviderContext("ts", tmp_path / "root" / "ts", batch_size=4, batches_per_file=3)
    p = create("token_shards", ctx, {"block_size": T, "vocab_size": 2000, **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def serve(p, tmp_path: Path, files: int) -> np.ndarray:
    """x of the first `files` files, one row per window."""
    out = tmp_path / "q"
    out.mkdir(exist_ok=True)
    rows = []
    for seq in range(files):
        made = p.produce_file("train", seq, out)
        rows.append(load_batch_file(out / str(made.name)).tensors["x"].reshape(-1, T))
    return torch.cat(rows).numpy()


def prepared_with_starts(tmp_path: Path, starts: list[int]) -> Path:
    """A prepared corpus of one shard, ids 1..300 in three documents of 100, whose .docs.npy
    is then replaced by `starts` (as many entries as the manifest's documents)."""
    docs = [np.arange(1, 101), np.arange(101, 201), np.arange(201, 301)]
    d = write_prepared(tmp_path / "prep", [docs], vocab_size=2000, eos_id=None)
    np.save(d / "shard-000000.docs.npy", np.array(starts, dtype=np.int64))
    return d


def megatron_with(
    prefix: Path, lengths: list[int], pointers: list[int], doc_index: list[int]
) -> Path:
    """PREFIX.bin of ids 1.. and PREFIX.idx holding these arrays as given (pointers in tokens,
    written as byte offsets of uint16), lies and all; the .bin is as long as the last
    sequence says, so start-up's checks pass. Returns the .idx."""
    end = pointers[-1] + lengths[-1]
    np.arange(1, end + 1, dtype="<u2").tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, len(lengths), len(doc_index)))
        f.write(np.array(lengths, dtype="<i4").tobytes())
        f.write((np.array(pointers, dtype="<i8") * 2).tobytes())
        f.write(np.array(doc_index, dtype="<i8").tobytes())
    return prefix.with_suffix(".idx")


def test_honest_document_starts_serve_every_token_once_per_epoch(tmp_path: Path) -> None:
    """The shapes the checks must let through: a prepared shard that continues a document
    (its first start is not 0) and a Megatron index with an empty last document."""
    d = prepared_with_starts(tmp_path, [20, 100, 200])
    idx = megatron_with(tmp_path / "m", [100, 100, 100], [0, 100, 200], [0, 1, 3, 3])
    for inputs in ([str(d)], [str(idx)]):
        p, meta = provider(tmp_path, {"inputs": inputs, "order": "documents"})
        n = meta["split_info"]["train"]["windows"]  # 37 windows of 8 in 300 tokens
        x = serve(p, tmp_path, -(-3 * n // 12))
        for epoch in range(3):
            served = x[epoch * n : (epoch + 1) * n]
            assert len(np.unique(served)) == served.size == n * T, inputs


@pytest.mark.parametrize(
    ("starts", "message"),
    [
        ([0, 250, 100], r"entry 2 is 100, below entry 1 \(250\): document starts must be sorted"),
        ([0, -100, 250], r"entry 1 is -100, outside the shard's 300 tokens"),
        ([0, 100, 400], r"entry 2 is 400, outside the shard's 300 tokens"),
    ],
)
def test_prepared_document_starts_that_lie_are_refused_naming_file_entry_and_value(
    tmp_path: Path, starts: list[int], message: str
) -> None:
    d = prepared_with_starts(tmp_path, starts)
    p, _ = provider(tmp_path, {"inputs": [str(d)], "order": "documents"})
    with pytest.raises(ConfigError, match=r"shard-000000\.docs\.npy: " + message):
        serve(p, tmp_path, 1)
    provider(tmp_path, {"inputs": [str(d)]})  # window order never reads the starts


def test_a_prepared_shard_said_to_start_with_a_document_must_list_offset_0(
    tmp_path: Path,
) -> None:
    d = prepared_with_starts(tmp_path, [20, 100, 200])
    manifest = d / "manifest.json"
    manifest.write_text(
        manifest.read_text().replace(
            '"documents": 3,', '"documents": 3, "continues_document": false,'
        )
    )
    p, _ = provider(tmp_path, {"inputs": [str(d)], "order": "documents"})
    with pytest.raises(ConfigError, match=r"docs\.npy: entry 0 is 20, but .* continues_document"):
        serve(p, tmp_path, 1)


@pytest.mark.parametrize(
    ("lengths", "pointers", "doc_index", "message"),
    [
        # Part of the lies that serve tokens twice: unsorted, negative, past the .bin's end.
        ([100, 50, 50, 20], [0, 250, 100, 300], [0, 1, 2, 3, 4],
         r"sequence pointer \[2\] is byte 200, before sequence pointer \[1\] \(byte 500\)"),
        ([100, 150, 50, 20], [0, -100, 100, 300], [0, 1, 2, 3, 4],
         r"sequence pointer \[1\] is byte -200, below 0"),
        ([100, 150, 50, 20], [0, 100, 900, 300], [0, 1, 2, 3, 4],
         r"sequence \[2\] \(byte 1800, 50 tokens\) runs past the end of .*m\.bin \(640 bytes\)"),
        ([100, 150, -50, 20], [0, 100, 250, 300], [0, 1, 2, 3, 4],
         r"sequence length \[2\] is -50, below 0"),
        # The document index: entries past the sequences, unsorted, not from 0 to S.
        ([100, 100, 100], [0, 100, 200], [0, 7, 3],
         r"document index \[1\] is 7, outside \[0, 3\] \(3 sequences\)"),
        ([100, 100, 100], [0, 100, 200], [0, 2, 1, 3],
         r"document index \[2\] is 1, below entry 1 \(2\): it must be sorted"),
        ([100, 100, 100], [0, 100, 200], [1, 2, 3],
         r"document index \[0\] is 1; the index starts at 0"),
        ([100, 100, 100], [0, 100, 200], [0, 1, 2],
         r"document index \[2\] is 2; the index ends with the sequence count, 3"),
    ],
)  # fmt: skip
def test_a_megatron_index_that_lies_is_refused_naming_file_and_entry(
    tmp_path: Path, lengths: list[int], pointers: list[int], doc_index: list[int], message: str
) -> None:
    idx = megatron_with(tmp_path / "m", lengths, pointers, doc_index)
    p, _ = provider(tmp_path, {"inputs": [str(idx)], "order": "documents"})
    with pytest.raises(ConfigError, match=r"m\.idx: " + message):
        serve(p, tmp_path, 1)


def test_lying_starts_fail_their_dataset_on_a_server_naming_the_file(tmp_path: Path) -> None:
    """On a real server (kept up with --keep-serving), each lying index fails its dataset at
    its first file, naming the file and the entry; no row of it is served."""

    cases = {
        "docs": (prepared_with_starts(tmp_path, [0, 250, 100]), "shard-000000.docs.npy: entry 2"),
        "mega": (
            megatron_with(tmp_path / "m", [100, 150, 50, 20], [0, 100, 900, 300], [0, 1, 2, 3, 4]),
            "m.idx: sequence [2]",
        ),
    }
    text = "[server]\nlease_ttl_s = 30\n"
    for name, (path, _) in cases.items():
        text += textwrap.dedent(
            f"""
            [datasets.{name}]
            provider = "token_shards"
            batch_size = 2
            batches_per_file = 2
            [datasets.{name}.args]
            inputs = ["{path.as_posix()}"]
            block_size = {T}
            vocab_size = 2000
            order = "documents"
            """
        )
    errors = errors_of_failed(tmp_path, text, cases, subprocess_env(), timeout_s=120)
    for name, (_, expect) in cases.items():
        assert expect in errors[name], (name, errors[name])


def test_a_prepared_shard_linked_out_of_its_folder_is_refused_and_one_inside_served(
    tmp_path: Path,
) -> None:
    d = write_prepared(tmp_path / "prep", [[np.arange(1, 101)]], vocab_size=2000, eos_id=None)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name in ("shard-000000.npy", "shard-000000.docs.npy"):
        (d / name).rename(outside / name)
        (d / name).symlink_to(outside / name)
        shown = re.escape(name)
        with pytest.raises(
            ConfigError,
            match=rf"prep/{shown} is a symlink to .*elsewhere/{shown}, outside the corpus folder",
        ):
            p, _ = provider(tmp_path, {"inputs": [str(d)], "order": "documents"})
            serve(p, tmp_path, 1)
        (d / name).unlink()
        (outside / name).rename(d / name)
    # A link that stays inside the folder is served, and so is the folder through a link.
    (d / "kept").mkdir()
    (d / "shard-000000.npy").rename(d / "kept" / "tokens.npy")
    (d / "shard-000000.npy").symlink_to(Path("kept") / "tokens.npy")
    (tmp_path / "alias").symlink_to(d)
    for inputs in ([str(d)], [str(tmp_path / "alias")]):
        p, _ = provider(tmp_path, {"inputs": inputs, "order": "documents"})
        assert serve(p, tmp_path, 1).min() >= 1


def npy_with_header(path: Path, array: np.ndarray, header_bytes: int, version: int = 1) -> Path:
    """A valid .npy whose header numpy's reader accepts, padded with spaces to about
    `header_bytes` (a 64-byte aligned total, as numpy pads)."""
    fields = repr({"descr": array.dtype.str, "fortran_order": False, "shape": array.shape})
    prefix = 10 if version == 1 else 12
    length = -(-(prefix + header_bytes) // 64) * 64 - prefix
    header = fields.ljust(length - 1).encode("latin1") + b"\n"
    size = struct.pack("<H" if version == 1 else "<I", length)
    path.write_bytes(b"\x93NUMPY" + bytes([version, 0]) + size + header + array.tobytes())
    return path


@pytest.mark.parametrize(("header_bytes", "version"), [(5000, 1), (20_000, 1), (70_000, 2)])
def test_npy_headers_over_4_kib_are_read(tmp_path: Path, header_bytes: int, version: int) -> None:
    ids = np.arange(1, 101, dtype=np.uint16)
    shard = npy_with_header(tmp_path / "x.npy", ids, header_bytes, version)
    assert np.array_equal(np.load(shard, allow_pickle=False, max_header_size=10**6), ids)
    p, _ = provider(tmp_path, {"inputs": [str(shard)]})
    assert sorted(serve(p, tmp_path, 1)[:, 0].tolist()) == list(range(1, 97, T))
    # A prepared shard's document starts with such a header are read too.
    d = write_prepared(tmp_path / "prep", [[ids[:40], ids[40:]]], vocab_size=2000, eos_id=None)
    npy_with_header(d / "shard-000000.docs.npy", np.array([0, 40]), header_bytes, version)
    p, _ = provider(tmp_path, {"inputs": [str(d)], "order": "documents"})
    x = serve(p, tmp_path, 1)
    assert len(np.unique(x)) == x.size


def test_an_npy_header_longer_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30) + b"{" * 64)
    with pytest.raises(ConfigError, match=r"x\.npy has a header of 1073741824 bytes"):
        provider(tmp_path, {"inputs": [str(path)]})
