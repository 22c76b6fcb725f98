"""token_shards in one process: each format's windows, its errors named, the epoch order."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.token_files import write_llmc, write_megatron, write_npy_bad, write_prepared, write_raw

from queue_client.errors import ConfigError
from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create
from queue_providers import inputs as inputs_module
from queue_providers.inputs import describe_inputs
from queue_providers.token_shards.order import EpochOrder

T = 8


def provider(tmp_path: Path, args: dict, batch_size: int = 4, batches_per_file: int = 3):
    ctx = ProviderContext(
        "ts", tmp_path / "root" / "ts", batch_size=batch_size, batches_per_file=batches_per_file
    )
    p = create("token_shards", ctx, {"block_size": T, **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def served_rows(p, split: str, seqs: range, tmp_path: Path) -> np.ndarray:
    out = tmp_path / "q"
    out.mkdir(exist_ok=True)
    rows = []
    for seq in seqs:
        f = load_batch_file(out / str(p.produce_file(split, seq, out).name))
        x, y = f.tensors["x"].reshape(-1, T), f.tensors["y"].reshape(-1, T)
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], 1).numpy())
    return np.concatenate(rows)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_epoch_order_is_a_bijection_and_differs_by_epoch(n: int) -> None:
    order = EpochOrder(n, 7, "train")
    first, second = order.permute(0, np.arange(n)), order.permute(1, np.arange(n))
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    if n >= 64:
        assert not np.array_equal(first, second)
        assert not np.array_equal(first, np.arange(n))
    assert np.array_equal(order.windows(np.arange(n, 2 * n)), second)


def test_every_window_once_per_epoch_across_formats(tmp_path: Path) -> None:
    # Ids equal their position in the corpus, so a row names the window it came from.
    raw = write_raw(tmp_path / "a.bin", np.arange(0, 100, dtype=np.uint16))
    llmc = write_llmc(tmp_path / "b.bin", np.arange(100, 181))
    npy = tmp_path / "c.npy"
    np.save(npy, np.arange(181, 250, dtype=np.uint16))
    mega = write_megatron(tmp_path / "d", [np.arange(250, 290), np.arange(290, 333)])
    p, meta = provider(
        tmp_path, {"inputs": [str(raw), str(llmc), str(npy), str(mega)], "vocab_size": 400}
    )
    kinds = [s.format for s in p.corpora["train"].shards]
    assert kinds == ["raw", "llmc", "npy", "megatron"]
    # (100-1)//8 + (81-1)//8 + (69-1)//8 + (83-1)//8 windows; none crosses a shard's end.
    n = 12 + 10 + 8 + 10
    assert meta["split_info"]["train"]["windows"] == n
    rows = served_rows(p, "train", range(0, 2 * n // 12 + 1), tmp_path)
    shard_first = {0: 0, 1: 100, 2: 181, 3: 250}
    allowed = {
        first + k * T for i, first in shard_first.items()
        for k in range(p.corpora["train"].first_window[i + 1] - p.corpora["train"].first_window[i])
    }  # fmt: skip
    for epoch in range(2):
        firsts = rows[epoch * n : (epoch + 1) * n, 0]
        assert sorted(firsts.tolist()) == sorted(allowed)
    assert not np.array_equal(rows[:n, 0], rows[n : 2 * n, 0])
    assert np.array_equal(rows, rows[:, :1] + np.arange(T + 1))  # contiguous windows


@pytest.mark.parametrize("sampling", ["epoch", "random"])
@pytest.mark.parametrize(
    ("vocab", "token_dtype"),
    [(400, "uint16"), (400, "uint32"), (70_000, "uint32")],
    ids=["uint16-shards", "uint32-shards-narrow-vocab", "uint32-ids"],
)
def test_files_are_the_ones_made_from_int64_windows(
    tmp_path: Path, vocab: int, token_dtype: str, sampling: str
) -> None:
    """Files are gathered straight into the stored window (narrow): byte for byte the file
    the base class makes from the same windows widened to int64 x and y (stacked, checked,
    encoded), whatever the shards' dtype against the stored one. In epoch order the
    reference reads the same rows; with random sampling it is sample_batch's own draws,
    batch by batch."""
    from queue_providers.base import DataProviderBase
    from queue_providers.token_shards.provider import xy

    gen = np.random.default_rng(3)
    ids = gen.integers(0, vocab, 600).astype(token_dtype)
    raw = write_raw(tmp_path / "a.bin", ids)
    args = {"inputs": [str(raw)], "vocab_size": vocab, "token_dtype": token_dtype}
    p, _ = provider(tmp_path, {**args, "sampling": sampling})
    for seq in (0, 1, 4, 9):  # past the first epoch of 74 windows: 6 files of 12 rows
        fast = p.make_file("train", seq)
        if sampling == "epoch":
            rows = np.arange(seq * p.rows_per_file, (seq + 1) * p.rows_per_file)
            shard, start = p.corpora["train"].locate(p.orders["train"].windows(rows))
            p._file_rows["train"] = [xy(torch.from_numpy(p.gather("train", shard, start))), 0]
        reference = DataProviderBase.make_file(p, "train", seq)
        p._file_rows.pop("train", None)
        assert (fast.crc32, bytes(fast.data)) == (reference.crc32, bytes(reference.data)), seq


def test_random_sampling_draws_nanogpt_starts_with_replacement(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "a.bin", np.arange(11, dtype=np.uint16))
    p, _ = provider(tmp_path, {"inputs": [str(raw)], "sampling": "random"}, batch_size=64)
    rows = served_rows(p, "train", range(2), tmp_path)
    assert set(rows[:, 0].tolist()) == {0, 1, 2}  # nanoGPT: starts in [0, 11 - 8)


def test_megatron_documents_come_from_the_index(tmp_path: Path) -> None:
    docs = [np.arange(5), np.arange(7), np.arange(3)]
    mega = write_megatron(tmp_path / "m", docs)
    p, _ = provider(tmp_path, {"inputs": [str(mega)]})
    assert p.corpora["train"].shards[0].doc_starts().tolist() == [0, 5, 12]


def test_prepared_corpus_reads_its_manifest_and_never_hashes_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = write_prepared(
        tmp_path / "prep",
        [[np.arange(1, 40), np.arange(1, 30)], [np.arange(1, 50)]],
        vocab_size=100,
    )
    p, meta = provider(tmp_path, {"inputs": [str(d)]})
    assert meta["vocab_size"] == 100 and meta["eos_id"] == 0
    assert [s.tokens for s in p.corpora["train"].shards] == [68, 49]
    assert p.corpora["train"].shards[1].doc_starts().tolist() == [0]
    hashed = []
    real = inputs_module.sha256_file
    monkeypatch.setattr(
        inputs_module, "sha256_file", lambda path: hashed.append(path) or real(path)
    )
    records = describe_inputs(p.input_files())
    assert [Path(h).name for h in hashed] == ["manifest.json"]
    assert {r.get("version", "")[:7] for k, r in records.items() if k.endswith(".npy")} == {
        "sha256:"
    }


def test_a_touched_raw_shard_changes_the_fingerprint_without_a_read(
    tmp_path: Path, monkeypatch
) -> None:
    raw = write_raw(tmp_path / "a.bin", np.arange(100, dtype=np.uint16))
    p, _ = provider(tmp_path, {"inputs": [str(raw)]})
    monkeypatch.setattr(inputs_module, "sha256_file", lambda path: pytest.fail(f"hashed {path}"))
    before = inputs_module.inputs_fingerprint(describe_inputs(p.input_files()))
    st = raw.stat()
    import os

    os.utime(raw, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert inputs_module.inputs_fingerprint(describe_inputs(p.input_files())) != before


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (
            lambda d: write_llmc(d / "x.bin", np.zeros(50), magic=123),
            {"format": "llmc"},
            r"x\.bin has magic 123 where an llm\.c shard has 20240520",
        ),
        (
            lambda d: write_llmc(d / "x.bin", np.zeros(50), version=3),
            {},
            r"x\.bin is llm\.c shard version 3",
        ),
        (
            lambda d: _cut(write_llmc(d / "x.bin", np.zeros(50)), 10),
            {},
            r"x\.bin is 1114 bytes but its header says 50 tokens.*truncated",
        ),
        (
            lambda d: _cut(write_llmc(d / "x.bin", np.zeros(50)), 2000),
            {},
            r"x\.bin is \d+ bytes, shorter than the 1024-byte llm\.c header",
        ),
        (
            lambda d: write_llmc(d / "x.bin", np.zeros(50)),
            {"token_dtype": "uint32", "vocab_size": 70000},
            r"x\.bin holds uint16 tokens but token_dtype = 'uint32'",
        ),
        (
            lambda d: _save(d / "x.npy", np.zeros(50, np.uint32)),
            {"token_dtype": "uint16"},
            r"x\.npy holds uint32 tokens but token_dtype = 'uint16'",
        ),
        (
            lambda d: _cut(_save(d / "x.npy", np.zeros(50, np.uint16)), 4),
            {},
            r"x\.npy is \d+ bytes but its header describes 50 uint16 tokens.*truncated",
        ),
        (
            lambda d: _save(d / "x.npy", np.zeros((5, 10), np.uint16)),
            {},
            r"x\.npy holds an array of shape \(5, 10\)",
        ),
        (
            lambda d: _save(d / "x.npy", np.zeros(50, np.float32)),
            {},
            r"x\.npy holds float32 values",
        ),
        (write_npy_bad, {}, r"x\.npy holds Python objects"),
        (
            lambda d: write_raw(d / "x.bin", np.zeros(51, np.uint8)),
            {"token_dtype": "uint16"},
            r"x\.bin is 51 bytes, not a multiple of 2",
        ),
        (
            lambda d: _corrupt_idx(write_megatron(d / "x", [np.zeros(30)])),
            {},
            r"x\.idx starts with b'MMIDIDY",
        ),
        (
            lambda d: _cut(write_megatron(d / "x", [np.zeros(30)]), 6),
            {},
            r"x\.bin is 54 bytes but .*x\.idx describes 30 uint16 tokens",
        ),
        (
            lambda d: write_prepared(d / "p", [[np.arange(30)]], vocab_size=500),
            {"vocab_size": 100},
            r"vocab_size = 100 in config but .*manifest\.json says 500",
        ),
        (
            lambda d: write_raw(d / "x.bin", np.full(30, 70, np.uint16)),
            {"vocab_size": 50, "sampling": "random", "_sample": True},
            r"x\.bin holds token id 70 outside \[0, vocab_size 50\)",
        ),
        (
            lambda d: write_raw(d / "x.bin", np.zeros(5, np.uint16)),
            {},
            r"split 'train' has no window of block_size\+1=9 tokens",
        ),
    ],
)
def test_errors_name_the_file_and_the_fault(tmp_path: Path, make, args: dict, message: str) -> None:
    made = make(tmp_path)
    args = dict(args)
    sample = args.pop("_sample", False)
    with pytest.raises((ConfigError, ValueError), match=message):
        p, _ = provider(tmp_path, {"inputs": [str(made)], **args})
        if sample:
            p.sample_batch("train", torch.Generator().manual_seed(0))


def _cut(path: Path, n: int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: max(0, len(data) - n)] if n < len(data) else data[:24])
    return path


def _save(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


def _corrupt_idx(bin_path: Path) -> Path:
    idx = bin_path.with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    data[6] = ord("Y")
    idx.write_bytes(bytes(data))
    return bin_path


def test_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented example, with llm.c shards where its globs look, serves a file per split."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    example = Path(__file__).resolve().parent.parent / "examples" / "configs" / "token_shards.toml"
    cfg = tomllib.loads(example.read_text())
    ((name, table),) = cfg["datasets"].items()
    assert table["provider"] == "token_shards"
    args = table["args"]
    for split, globs in args["inputs"].items():
        directory = tmp_path / Path(globs[0]).parent
        directory.mkdir(parents=True, exist_ok=True)
        for i in range(2):
            write_llmc(directory / f"fineweb_{split}_{i:06d}.bin", np.arange(5000) % 50257)
    monkeypatch.chdir(tmp_path)  # the server resolves relative args against the config's dir
    ctx = ProviderContext(
        name, tmp_path / "root" / name, batch_size=table["batch_size"], batches_per_file=2
    )
    p = create(table["provider"], ctx, args)
    p.set_meta(p.complete_meta())
    (tmp_path / "q").mkdir()
    for split in ("train", "val"):
        published = p.produce_file(split, 0, tmp_path / "q")
        f = load_batch_file(tmp_path / "q" / str(published.name))
        assert f.tensors["x"].shape == (2, table["batch_size"], args["block_size"])


def test_a_directory_input_takes_its_token_files_in_order_and_nothing_beside_them(
    tmp_path: Path,
) -> None:
    d = tmp_path / "corpus"
    d.mkdir()
    write_raw(d / "b.bin", np.arange(50, 100, dtype=np.uint16))
    write_raw(d / "a.bin", np.arange(0, 50, dtype=np.uint16))
    write_megatron(d / "c", [np.arange(100, 130)])
    np.save(d / "a.docs.npy", np.zeros(1, np.int64))
    (d / "notes.json").write_text("{}")
    (d / ".hidden.bin").write_bytes(b"\xff" * 64)
    p, _ = provider(tmp_path, {"inputs": [str(d)], "vocab_size": 200})
    shards = p.corpora["train"].shards
    assert [(Path(s.shown).name, s.format) for s in shards] == [
        ("a.bin", "raw"),
        ("b.bin", "raw"),
        ("c.bin", "megatron"),
    ]
