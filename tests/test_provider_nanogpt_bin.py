"""nanogpt_bin: windows are direct slices of nanoGPT's .bin memmaps, read as nanoGPT writes them."""

from __future__ import annotations

import pickle
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import train_losses
from queue_client.errors import ConfigError
from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create
from queue_providers import nanogpt_bin as nb

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "configs" / "nanogpt_bin.toml"


def write_nanogpt_dir(
    d: Path, train: np.ndarray, val: np.ndarray, meta: dict | None = None
) -> Path:
    """A dataset dir as nanoGPT's prepare.py scripts leave it."""
    d.mkdir(parents=True, exist_ok=True)
    train.tofile(d / "train.bin")
    val.tofile(d / "val.bin")
    if meta is not None:
        (d / "meta.pkl").write_bytes(pickle.dumps(meta))
    return d


def char_meta(vocab_size: int) -> dict:
    chars = [chr(ord("!") + i) for i in range(vocab_size)]
    return {
        "vocab_size": vocab_size,
        "itos": dict(enumerate(chars)),
        "stoi": {c: i for i, c in enumerate(chars)},
    }


def provider(tmp_path: Path, args: dict, batch_size: int = 8, batches_per_file: int = 4):
    ctx = ProviderContext(
        "ng", tmp_path / "ds", batch_size=batch_size, batches_per_file=batches_per_file
    )
    p = create("nanogpt_bin", ctx, args)
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def test_windows_equal_direct_memmap_slices_at_the_same_offsets(tmp_path: Path) -> None:
    gen = np.random.default_rng(0)
    d = write_nanogpt_dir(
        tmp_path / "owt",
        gen.integers(0, 50257, 20_000, dtype=np.uint16),
        gen.integers(0, 50257, 5_000, dtype=np.uint16),
    )
    p, meta = provider(tmp_path, {"data_dir": str(d), "block_size": 64})
    assert meta["vocab_size"] == nb.GPT2_VOCAB_SIZE and meta["token_dtype"] == "uint16"
    for split in ("train", "val"):
        direct = np.memmap(d / f"{split}.bin", dtype=np.uint16, mode="r")
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            starts = p.window_starts(split, g)
            batch = p.windows(split, starts)
            for row, s in enumerate(starts.tolist()):
                assert torch.equal(
                    batch["x"][row], torch.from_numpy(direct[s : s + 64].astype(np.int64))
                )
                assert torch.equal(
                    batch["y"][row], torch.from_numpy(direct[s + 1 : s + 65].astype(np.int64))
                )


def test_produced_files_hold_memmap_slices_and_offsets_cover_the_file_uniformly(
    tmp_path: Path,
) -> None:
    # uint32 ids (vocab > 65535) that equal their own offset, so every row names where it came from.
    n_train, n_val, t = 100_000, 30_000, 32
    d = write_nanogpt_dir(
        tmp_path / "big",
        np.arange(n_train, dtype=np.uint32),
        np.arange(n_train, n_train + n_val, dtype=np.uint32),
        {"vocab_size": 140_000},
    )
    p, meta = provider(
        tmp_path, {"data_dir": str(d), "block_size": t}, batch_size=64, batches_per_file=25
    )
    assert meta["token_dtype"] == "uint32"
    out = tmp_path / "queue"
    out.mkdir()
    offsets = []
    for split, n in (("train", n_train), ("val", n_val)):
        direct = np.memmap(d / f"{split}.bin", dtype=np.uint32, mode="r")
        for seq in range(4 if split == "train" else 1):
            f = load_batch_file(out / str(p.produce_file(split, seq, out).name))
            x, y = f.tensors["x"].reshape(-1, t), f.tensors["y"].reshape(-1, t)
            base = 0 if split == "train" else n_train
            for row in range(len(x)):
                s = int(x[row, 0]) - base
                assert 0 <= s <= n - t - 1
                assert torch.equal(x[row], torch.from_numpy(direct[s : s + t].astype(np.int64)))
                assert torch.equal(
                    y[row], torch.from_numpy(direct[s + 1 : s + t + 1].astype(np.int64))
                )
                if split == "train":
                    offsets.append(s)
    # 6400 offsets in 8 equal bins: 800 expected per bin, sd ~26; allow +-20% (about 6 sd).
    counts = np.histogram(offsets, bins=8, range=(0, n_train - t))[0]
    assert np.all(np.abs(counts - len(offsets) / 8) < 0.2 * len(offsets) / 8), counts


def test_every_valid_offset_and_only_those_is_drawn(tmp_path: Path) -> None:
    # 11 tokens, block_size 8: nanoGPT's offsets are 0, 1 and 2 (y needs data[i+8]).
    d = write_nanogpt_dir(
        tmp_path / "d", np.arange(11, dtype=np.uint16), np.arange(11, dtype=np.uint16)
    )
    p, _ = provider(tmp_path, {"data_dir": str(d), "block_size": 8}, batch_size=64)
    g = torch.Generator().manual_seed(0)
    firsts = {int(v) for _ in range(10) for v in p.sample_batch("train", g)["x"][:, 0]}
    assert firsts == {0, 1, 2}


def test_files_are_a_pure_function_of_seed_split_and_seq(tmp_path: Path) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d", np.arange(5000, dtype=np.uint16), np.arange(3000, dtype=np.uint16)
    )
    a, _ = provider(tmp_path, {"data_dir": str(d), "block_size": 16})
    b, _ = provider(tmp_path, {"data_dir": str(d), "block_size": 16})
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    out_a.mkdir()
    out_b.mkdir()
    b.produce_file("train", 0, out_b)  # another seq first must not change seq 3
    fa = load_batch_file(out_a / str(a.produce_file("train", 3, out_a).name))
    fb = load_batch_file(out_b / str(b.produce_file("train", 3, out_b).name))
    assert torch.equal(fa.tensors["x"], fb.tensors["x"])


def test_the_memmap_is_opened_once_per_split_not_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d", np.arange(5000, dtype=np.uint16), np.arange(3000, dtype=np.uint16)
    )
    opened = []
    real = np.memmap

    def counting(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(nb.np, "memmap", counting)
    p, _ = provider(tmp_path, {"data_dir": str(d), "block_size": 16}, batches_per_file=20)
    out = tmp_path / "q"
    out.mkdir()
    for seq in range(3):
        p.produce_file("train", seq, out)
        p.produce_file("val", seq, out)
    assert sorted(Path(x).name for x in opened) == ["train.bin", "val.bin"]


def test_shakespeare_char_meta_pkl_is_carried_into_meta(tmp_path: Path) -> None:
    m = char_meta(65)
    d = write_nanogpt_dir(
        tmp_path / "sc",
        np.arange(2000, dtype=np.uint16) % 65,
        np.arange(500, dtype=np.uint16) % 65,
        m,
    )
    _, meta = provider(tmp_path, {"data_dir": str(d), "block_size": 32})
    assert meta["vocab_size"] == 65 and meta["training_type"] == "LM"
    assert meta["stoi"] == m["stoi"] and meta["itos"] == m["itos"]
    assert meta["split_info"] == {
        "train": {"tokens": 2000, "file": "train.bin"},
        "val": {"tokens": 500, "file": "val.bin"},
    }
    assert [(f["name"], f["dtype"], f["shape"]) for f in meta["batch_schema"]] == [
        ("x", "int64", [32]),
        ("y", "int64", [32]),
    ]


@pytest.mark.parametrize(
    ("dtype", "vocab_meta", "nbytes"),
    [(np.uint16, None, 2 * 1000 + 1), (np.uint32, 100_000, 4 * 1000 + 2)],
)
def test_bin_length_not_a_multiple_of_the_dtype_size_fails_at_start(
    tmp_path: Path, dtype, vocab_meta, nbytes
) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d",
        np.zeros(1000, dtype=dtype),
        np.zeros(1000, dtype=dtype),
        None if vocab_meta is None else {"vocab_size": vocab_meta},
    )
    (d / "val.bin").write_bytes(b"\0" * nbytes)
    with pytest.raises(
        ConfigError,
        match=r"val\.bin is \d+ bytes, not a multiple of " + str(np.dtype(dtype).itemsize),
    ):
        create(
            "nanogpt_bin",
            ProviderContext("ng", tmp_path, batch_size=2),
            {"data_dir": str(d), "block_size": 8},
        )


@pytest.mark.parametrize(
    ("args", "meta", "message"),
    [
        (
            {"block_size": 8, "vocab_size": 100},
            {"vocab_size": 65},
            r"vocab_size=100 in config but .*meta\.pkl says 65",
        ),
        ({"block_size": 1000}, None, r"train\.bin holds 500 tokens, fewer than block_size\+1=1001"),
        ({"block_size": 8, "splits": ["train", "test"]}, None, r"test\.bin is missing"),
        ({"block_size": 0}, None, r"block_size must be a positive int"),
    ],
)
def test_bad_config_fails_at_start_naming_the_problem(
    tmp_path: Path, args: dict, meta: dict | None, message: str
) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d", np.zeros(500, dtype=np.uint16), np.zeros(500, dtype=np.uint16), meta
    )
    with pytest.raises(ConfigError, match=message):
        create(
            "nanogpt_bin",
            ProviderContext("ng", tmp_path, batch_size=2),
            {"data_dir": str(d), **args},
        )


def test_meta_pkl_that_names_a_class_is_refused(tmp_path: Path) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d", np.zeros(500, dtype=np.uint16), np.zeros(500, dtype=np.uint16)
    )
    (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": np.int64(65)}))
    with pytest.raises(ConfigError, match=r"meta\.pkl is not a plain-data pickle"):
        create("nanogpt_bin", ProviderContext("ng", tmp_path, batch_size=2), {"data_dir": str(d)})


def test_token_id_beyond_vocab_size_is_reported_with_the_file(tmp_path: Path) -> None:
    d = write_nanogpt_dir(
        tmp_path / "d",
        np.full(500, 70, dtype=np.uint16),
        np.zeros(500, dtype=np.uint16),
        {"vocab_size": 65},
    )
    p, _ = provider(tmp_path, {"data_dir": str(d), "block_size": 8})
    with pytest.raises(ValueError, match=r"train\.bin holds token id 70 >= vocab_size 65"):
        p.sample_batch("train", torch.Generator().manual_seed(0))


def test_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented example, with a shakespeare_char-style dir where it says, serves a file."""
    cfg = tomllib.loads(EXAMPLE.read_text())
    ((name, table),) = cfg["datasets"].items()
    assert table["provider"] == "nanogpt_bin"
    m = char_meta(65)
    write_nanogpt_dir(
        tmp_path / table["args"]["data_dir"],
        np.arange(20_000, dtype=np.uint16) % 65,
        np.arange(3000, dtype=np.uint16) % 65,
        m,
    )
    monkeypatch.chdir(tmp_path)  # the server resolves relative args against the config's dir
    ctx = ProviderContext(
        name, tmp_path / "root" / name, batch_size=table["batch_size"], batches_per_file=2
    )
    p = create(table["provider"], ctx, table["args"])
    p.set_meta(p.complete_meta())
    (tmp_path / "q").mkdir()
    f = load_batch_file(tmp_path / "q" / str(p.produce_file("train", 0, tmp_path / "q").name))
    assert f.tensors["x"].shape == (2, table["batch_size"], table["args"]["block_size"])


def test_tiny_lm_trains_through_queue_client(tmp_path: Path, start_server) -> None:
    from queue_client.client import QueueClient

    vocab, t = 65, 32
    # A sequence a bigram model can learn: mostly next = (cur + 1) % vocab.
    gen = np.random.default_rng(0)
    seq = np.cumsum(np.where(gen.random(60_000) < 0.9, 1, gen.integers(0, vocab, 60_000))) % vocab
    d = write_nanogpt_dir(
        tmp_path / "sc",
        seq[:50_000].astype(np.uint16),
        seq[50_000:].astype(np.uint16),
        char_meta(vocab),
    )
    server = start_server(
        textwrap.dedent(
            f"""
            [datasets.sc]
            provider = "nanogpt_bin"
            batch_size = 16
            batches_per_file = 10
            [datasets.sc.args]
            data_dir = "{d.as_posix()}"
            block_size = {t}
            """
        )
    )
    client = QueueClient(server.address, "sc", rank=0, world_size=1, device="cpu")
    try:
        assert client.meta["training_type"] == "LM" and client.meta["vocab_size"] == vocab
        torch.manual_seed(0)
        model = torch.nn.Embedding(vocab, vocab)
        losses = train_losses(
            client,
            model.parameters(),
            lambda xy: torch.nn.functional.cross_entropy(
                model(xy[0]).view(-1, vocab), xy[1].view(-1)
            ),
            lr=0.1,
        )
        xv, _ = client.get_batch("val")
        assert xv.shape == (16, t) and xv.dtype == torch.int64
    finally:
        client.close()
    # From ln(65) ~ 4.17 a bigram learns the +1 rule within a few steps.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
