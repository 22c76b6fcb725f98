"""char_diffusion: mask rates per stage, x/y consistency, and the stage curriculum by batch position."""

from __future__ import annotations

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

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "char_diffusion.toml"
IGNORE = -100


def write_text(path: Path, chars: int = 60_000) -> Path:
    gen = np.random.default_rng(0)
    words = ["the", "queue", "leases", "a", "batch", "file", "to", "each", "rank", "and", "seq"]
    text = " ".join(words[i] for i in gen.integers(0, len(words), chars // 4))[:chars]
    path.write_text(text, encoding="utf-8")
    return path


def provider(tmp_path: Path, *, batch_size: int = 32, batches_per_file: int = 4, **args):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        write_text(corpus)
    ctx = ProviderContext(
        "cd", tmp_path / "ds", batch_size=batch_size, batches_per_file=batches_per_file
    )
    p = create("char_diffusion", ctx, {"input": str(corpus), **args})
    meta = p.complete_meta()
    p.set_meta(meta)
    return p, meta


def masked_fraction(y: torch.Tensor) -> torch.Tensor:
    """Per-row fraction of positions with a target."""
    return (y != IGNORE).double().mean(dim=-1)


def test_fixed_rate_masks_that_fraction_and_x_y_agree(tmp_path: Path) -> None:
    p, meta = provider(tmp_path, batch_size=64, block_size=256, stages=[{"mask_rate": 0.3}])
    text = (tmp_path / "corpus.txt").read_text()
    itos, mask_id = meta["itos"], meta["mask_token_id"]
    assert mask_id == meta["vocab_size"] - 1 and itos[mask_id] == "[MASK]"
    g = torch.Generator().manual_seed(0)
    ys = []
    for _ in range(8):  # 8 * 64 * 256 = 131k tokens
        b = p.sample_batch("train", g)
        x, y = b["x"], b["y"]
        target = y != IGNORE
        assert torch.all(x[target] == mask_id), "every position with a target is masked in x"
        assert torch.all(x[~target] != mask_id), "no position without a target is masked"
        clean = torch.where(target, y, x)
        for row in clean[:4].tolist():
            assert "".join(itos[i] for i in row) in text, "x/y reassemble a window of the text"
        ys.append(y)
    frac = masked_fraction(torch.cat(ys)).mean().item()
    # Bernoulli(0.3) over 131k tokens: sd ~0.0013; allow 0.01.
    assert abs(frac - 0.3) < 0.01, frac


def test_range_stage_draws_one_rate_per_sample_uniformly(tmp_path: Path) -> None:
    p, _ = provider(tmp_path, batch_size=128, block_size=1024, stages=[{"mask_rate": [0.2, 0.6]}])
    g = torch.Generator().manual_seed(0)
    fracs = torch.cat([masked_fraction(p.sample_batch("train", g)["y"]) for _ in range(4)]).numpy()
    # 512 rows of 1024 tokens: a row's fraction is its rate +- sd <= 0.016.
    assert fracs.min() > 0.2 - 0.06 and fracs.max() < 0.6 + 0.06, (fracs.min(), fracs.max())
    assert abs(fracs.mean() - 0.4) < 0.01, fracs.mean()
    # Rates uniform on [0.2, 0.6]: deciles at 0.24 and 0.56; allow 0.03 (rate sampling sd ~0.007).
    lo, hi = np.quantile(fracs, [0.1, 0.9])
    assert abs(lo - 0.24) < 0.03 and abs(hi - 0.56) < 0.03, (lo, hi)


def test_stages_switch_at_their_batch_positions_and_val_uses_the_last(tmp_path: Path) -> None:
    stages = [
        {"mask_rate": 0.1, "batches": 6},
        {"mask_rate": 0.5, "batches": 4},
        {"mask_rate": 0.9},
    ]
    p, meta = provider(tmp_path, batch_size=32, block_size=256, batches_per_file=4, stages=stages)
    assert meta["stages"] == [
        {"mask_rate": 0.1, "batches": 6},
        {"mask_rate": 0.5, "batches": 4},
        {"mask_rate": 0.9, "batches": None},
    ]
    out = tmp_path / "q"
    out.mkdir()
    # Files 2 then 0 then 1: a file's stages depend on its seq alone.
    got = {}
    for seq in (2, 0, 1):
        f = load_batch_file(out / str(p.produce_file("train", seq, out).name))
        got[seq] = masked_fraction(f.tensors["y"].flatten(1)).tolist()
    per_batch = got[0] + got[1] + got[2]
    expected = [0.1] * 6 + [0.5] * 4 + [0.9] * 2
    # 8192 tokens per batch: sd <= 0.0055; allow 0.03.
    assert np.allclose(per_batch, expected, atol=0.03), per_batch
    f = load_batch_file(out / str(p.produce_file("val", 0, out).name))
    assert np.allclose(masked_fraction(f.tensors["y"].flatten(1)).tolist(), [0.9] * 4, atol=0.03)


def test_meta_and_schema(tmp_path: Path) -> None:
    _, meta = provider(tmp_path, block_size=64)
    text = (tmp_path / "corpus.txt").read_text()
    assert meta["training_type"] == "MLM"
    assert meta["vocab_size"] == len(set(text)) + 1
    assert meta["stoi"] == {c: i for i, c in enumerate(sorted(set(text)))}
    assert meta["split_info"] == {"train": {"tokens": 54_000}, "val": {"tokens": 6000}}
    assert [(f["name"], f["dtype"], f["shape"]) for f in meta["batch_schema"]] == [
        ("x", "int64", [64]),
        ("y", "int64", [64]),
    ]
    assert meta["stages"] == [{"mask_rate": [0.05, 1.0], "batches": None}]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([], r"stages must be a non-empty list"),
        ([{"mask_rate": 0.0}], r"stages\[0\]\.mask_rate 0\.0 must satisfy 0 < lo <= hi <= 1"),
        ([{"mask_rate": 1.5}], r"stages\[0\]\.mask_rate 1\.5"),
        ([{"mask_rate": [0.6, 0.2]}], r"stages\[0\]\.mask_rate \[0\.6, 0\.2\]"),
        ([{"mask_rate": "high"}], r"stages\[0\]\.mask_rate must be a number or \[lo, hi\]"),
        ([{"mask_rate": 0.1}, {"mask_rate": 0.2}], r"stages\[0\]\.batches must be a positive int"),
        ([{"mask_rate": 0.1, "batches": 5}], r"stages\[0\] is the last stage"),
        ([{"mask_rate": 0.1, "steps": 5}], r"stages\[0\] has unknown key\(s\) \['steps'\]"),
        ([{"batches": 5}, {"mask_rate": 0.1}], r"stages\[0\] lacks mask_rate"),
    ],
)
def test_bad_stages_fail_at_start(tmp_path: Path, stages: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create(
            "char_diffusion",
            ProviderContext("cd", tmp_path, batch_size=2),
            {"input": str(write_text(tmp_path / "c.txt")), "stages": stages},
        )


def test_text_shorter_than_a_window_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"the val split has 100 characters, fewer than block_size=256"
    ):
        create(
            "char_diffusion",
            ProviderContext("cd", tmp_path, batch_size=2),
            {"input": str(write_text(tmp_path / "c.txt", 1000)), "block_size": 256},
        )


def test_example_config_runs(tmp_path: Path) -> None:
    """The documented example needs no data (Python's stdlib sources are the text)."""
    cfg = tomllib.loads(EXAMPLE.read_text())
    ((name, table),) = cfg["datasets"].items()
    assert table["provider"] == "char_diffusion" and "input" not in table["args"]
    ctx = ProviderContext(name, tmp_path / name, batch_size=table["batch_size"], batches_per_file=2)
    p = create(table["provider"], ctx, table["args"])
    p.set_meta(p.complete_meta())
    f = load_batch_file(tmp_path / str(p.produce_file("train", 0, tmp_path).name))
    assert f.tensors["x"].shape == (2, table["batch_size"], table["args"]["block_size"])


class TinyDenoiser(torch.nn.Module):
    """Embedding, one convolution over neighbours, and a per-position classifier."""

    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.conv = torch.nn.Conv1d(dim, dim, kernel_size=5, padding=2)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(self.emb(x).transpose(1, 2))).transpose(1, 2)
        return self.out(h)


def test_tiny_denoiser_trains_through_queue_client(tmp_path: Path, start_server) -> None:
    from queue_client.client import QueueClient

    corpus = tmp_path / "abc.txt"
    corpus.write_text("abcdefghijklmnopqrstuvwxyz" * 2000)
    server = start_server(
        textwrap.dedent(
            f"""
            [datasets.cd]
            provider = "char_diffusion"
            batch_size = 16
            batches_per_file = 10
            [datasets.cd.args]
            input = "{corpus.as_posix()}"
            block_size = 64
            stages = [{{ mask_rate = 0.3 }}]
            """
        )
    )
    client = QueueClient(server.address, "cd", rank=0, world_size=1, device="cpu")
    try:
        vocab = client.meta["vocab_size"]
        assert client.meta["training_type"] == "MLM" and vocab == 27
        torch.manual_seed(0)
        model = TinyDenoiser(vocab)
        losses = train_losses(
            client,
            model.parameters(),
            lambda xy: torch.nn.functional.cross_entropy(
                model(xy[0]).reshape(-1, vocab), xy[1].reshape(-1), ignore_index=IGNORE
            ),
            lr=0.02,
        )
    finally:
        client.close()
    # From ln(27) ~ 3.3; neighbours give the masked letter away.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
