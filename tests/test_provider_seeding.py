"""File seeds keep all their bits: no two files of a split repeat, not even the seqs whose
derived seeds agree in the 32 bits that torch's manual_seed would keep."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from queue_client.format.batchfile import load_batch_file
from queue_providers import ProviderContext, create
from queue_providers.seeding import derive_seed, torch_generator

SEED = 1337  # ProviderContext's default seed
LOW_32 = 0xFFFFFFFF


def first_low_32_collision(seed: int, split: str, limit: int = 100_000) -> tuple[int, int]:
    """The first two seqs of `split` whose derived seeds agree in their low 32 bits."""
    seen: dict[int, int] = {}
    for seq in range(limit):
        low = derive_seed(seed, split, seq) & LOW_32
        if low in seen:
            return seen[low], seq
        seen[low] = seq
    raise AssertionError(f"no two of the first {limit} seqs of {split!r} share 32 low seed bits")


def first_draw(gen: torch.Generator) -> tuple[int, int]:
    return tuple(torch.randint(1 << 62, (2,), generator=gen).tolist())


def test_seeds_that_differ_in_any_one_bit_give_different_generators() -> None:
    """torch_generator(s) depends on each of the 64 bits of s, and on nothing else."""
    base = (1 << 63) | 0x5DEECE66D
    draws = {first_draw(torch_generator(base ^ (1 << bit))) for bit in range(64)}
    assert len(draws) == 64 and first_draw(torch_generator(base)) not in draws
    assert first_draw(torch_generator(base)) == first_draw(torch_generator(base))
    assert torch_generator(base).initial_seed() == base


def test_torch_generator_draws_the_twister_stream_of_random_random() -> None:
    """The installed state is init_by_array's of the whole seed: torch.rand (float32, the low
    24 bits of each 32-bit output) follows Python's random.Random(seed) output for output."""
    for seed in (0, 5, (1 << 62) + 12345, (1 << 64) - 1):
        ref = random.Random(seed)
        want = [ref.getrandbits(32) & 0xFFFFFF for _ in range(2000)]
        got = (torch.rand(2000, generator=torch_generator(seed)) * (1 << 24)).long().tolist()
        assert got == want, f"seed {seed}"


def test_torch_generator_refuses_a_seed_outside_64_bits() -> None:
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match=r"2\*\*64"):
            torch_generator(bad)


def _char_text(tmp_path: Path) -> Path:
    gen = np.random.default_rng(0)
    words = ["queue", "lease", "batch", "file", "rank", "seq", "split", "seed"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(words[i] for i in gen.integers(0, len(words), 4000)))
    return path


def _nanogpt_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    gen = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("val", 5_000)):
        gen.integers(0, 50257, n, dtype=np.uint16).tofile(d / f"{split}.bin")
    return d


PROVIDERS: dict[str, Any] = {
    "char_lm": lambda tmp: {"input": str(_char_text(tmp)), "block_size": 16},
    "char_diffusion": lambda tmp: {"input": str(_char_text(tmp)), "block_size": 16},
    "nanogpt_bin": lambda tmp: {"data_dir": str(_nanogpt_dir(tmp)), "block_size": 16},
}


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_files_whose_seeds_share_the_low_32_bits_differ(tmp_path: Path, name: str) -> None:
    """Seqs 16502 and 17600 of train (seed 1337) made the same file while only 32 bits of
    the seed reached the generator; now they differ, as every other pair does."""
    a, b = first_low_32_collision(SEED, "train")
    assert (a, b) == (16502, 17600)
    assert derive_seed(SEED, "train", a) != derive_seed(SEED, "train", b)
    ctx = ProviderContext(name, tmp_path / name, batch_size=4, batches_per_file=2, seed=SEED)
    provider = create(name, ctx, PROVIDERS[name](tmp_path))
    provider.set_meta(provider.complete_meta())
    out = tmp_path / "queue"
    out.mkdir()
    files = [
        load_batch_file(out / str(provider.produce_file("train", s, out).name)) for s in (a, b)
    ]
    assert files[0].tensors.keys() == files[1].tensors.keys()
    assert any(not torch.equal(files[0].tensors[k], files[1].tensors[k]) for k in files[0].tensors)


def test_no_two_of_20000_files_of_a_split_start_from_the_same_draw(tmp_path: Path) -> None:
    """The first draw of each file's generator over seqs 0..19999 of train: all distinct
    (the range holds the low-32-bit collision above)."""
    ctx = ProviderContext("chars", tmp_path, batch_size=1, seed=SEED)
    provider = create("char_lm", ctx, {"input": str(_char_text(tmp_path)), "block_size": 16})
    draws = {first_draw(provider.file_rng("train", seq)) for seq in range(20_000)}
    assert len(draws) == 20_000, f"{20_000 - len(draws)} files repeat another's first draw"


@pytest.mark.parametrize("seed", [0, 5, 1337, (1 << 62) + 12345, (1 << 64) - 1])
def test_randint_draws_are_torch_randint_of_the_same_generator(seed: int) -> None:
    """randint_draws draws, with numpy, what torch.randint draws from torch_generator(seed):
    one 32-bit output per value below 2**28, two (a 64-bit value) from there up, in both
    cases reduced modulo the range. char_lm's files depend on it (test_provider_vectorised
    checks them byte for byte); the installed torch is the reference."""
    from queue_providers.seeding import randint_draws

    for high in (1, 2, 3, 1000, 1_000_003, (1 << 28) - 1, 1 << 28, (1 << 28) + 1, (1 << 32) + 5,
                 (1 << 62) + 3, (1 << 63) - 1):  # fmt: skip
        want = torch.randint(high, (3000,), generator=torch_generator(seed)).numpy()
        got = randint_draws(seed, high, 3000)
        assert got.dtype == np.int64 and np.array_equal(got, want), f"high {high}"
    # Draws one after another from one generator are the draws of their total count.
    gen = torch_generator(seed)
    parts = torch.cat([torch.randint(1000, (3, 1), generator=gen) for _ in range(5)])
    assert np.array_equal(parts.reshape(-1).numpy(), randint_draws(seed, 1000, 15))


def test_randint_draws_refuses_a_range_or_seed_it_cannot_draw() -> None:
    from queue_providers.seeding import randint_draws

    for bad in (0, -3, 1 << 63):
        with pytest.raises(ValueError, match=r"high must lie in \[1, 2\*\*63\)"):
            randint_draws(1, bad, 4)
    with pytest.raises(ValueError, match=r"2\*\*64"):
        randint_draws(-1, 10, 4)
