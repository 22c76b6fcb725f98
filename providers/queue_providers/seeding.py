"""Seeds derived from (seed, parts...), and torch generators that keep every bit of them.

`torch.Generator().manual_seed(s)` keeps only the low 32 bits of `s` on the CPU: the Mersenne
Twister's seeding (`mt19937_engine::init_with_uint32`) fills its 624-word state from
`s & 0xffffffff`, although `initial_seed()` still reports all 64. Two files of a split whose
63-bit derived seeds agree in those 32 bits would be the same file: n files hold about
n**2 / 2**33 such pairs, one in the first 100,000 (seqs 16502 and 17600 of split "train"
with seed 1337 are one). So `torch_generator` fills the whole state from the full seed
instead, with the Twister authors' `init_by_array` (the seeding of Python's `random.seed(int)`,
which takes the seed 32 bits at a time), and installs it with `Generator.set_state`: the
generator then draws exactly the stream of `random.Random(seed)`.

`randint_draws` gives what `torch.randint(high, ...)` draws from such a generator, with numpy
alone: a worker whose provider samples window starts that way (char_lm) then never imports
torch, which is most of a worker's start and of its memory. tests/test_provider_seeding.py
checks it against the installed torch, draw for draw.
"""

from __future__ import annotations

import hashlib
import random
import threading
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["derive_seed", "randint_draws", "torch_generator"]

_MT_WORDS = 624
# torch's CPU generator state is the byte image of CPUGeneratorImplState, the format that
# torch.get_rng_state() saves in checkpoints: uint64 seed, int left, int seeded, uint64 next,
# then the 624 Mersenne Twister words as 624 uint64, then cached normal samples.
_STATE_BYTES = 5056
_WORDS_AT = 24
# torch.randint on the CPU takes one 32-bit output per value below this range, and one 64-bit
# value of two outputs (the first its high word) from it up, each reduced modulo the range.
_ONE_WORD_BELOW = 1 << 28


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from (seed, parts...), stable across processes and Python versions."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def mt19937_words(seed: int) -> np.ndarray:
    """The 624 Mersenne Twister state words that init_by_array makes of all of `seed`."""
    return np.array(random.Random(seed).getstate()[1][:_MT_WORDS], dtype=np.uint64)


def torch_generator(seed: int) -> torch.Generator:
    """A CPU torch.Generator whose whole state depends on all 64 bits of `seed`.

    initial_seed() is `seed`, and the first draw twists the installed words, as after
    manual_seed. Raises RuntimeError when this torch lays its generator state out otherwise.
    """
    import torch

    _check_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    state = gen.get_state()
    raw = state.numpy()
    words = raw[_WORDS_AT : _WORDS_AT + 8 * _MT_WORDS].view(np.uint64)
    # Where manual_seed just wrote: the seed itself, and init_genrand's first word.
    if (
        raw.size != _STATE_BYTES
        or int(raw[:8].view(np.uint64)[0]) != seed
        or int(words[0]) != seed & 0xFFFFFFFF
    ):
        raise RuntimeError(
            f"torch {torch.__version__} lays out its CPU generator state otherwise than "
            f"queue_providers.seeding expects ({_STATE_BYTES} bytes, the Mersenne Twister words "
            f"at byte {_WORDS_AT}); file seeds cannot be installed"
        )
    words[:] = mt19937_words(seed)
    gen.set_state(state)
    return gen


def randint_draws(seed: int, high: int, count: int) -> np.ndarray:
    """The int64 values of `torch.randint(high, (count,), generator=torch_generator(seed))`,
    drawn without torch: the same Twister stream (numpy's MT19937 from the same words), reduced
    the way torch's CPU kernel reduces it. Draws made one after another from one generator
    are this of their total count (randint fills a tensor in order)."""
    _check_seed(seed)
    if not 0 < high < 1 << 63:
        raise ValueError(f"high must lie in [1, 2**63), got {high!r}")
    twister = getattr(_twisters, "twister", None)
    if twister is None:  # one per thread, made once: a new one seeds itself from the OS
        twister = _twisters.twister = np.random.MT19937(0)
    words = mt19937_words(seed).astype(np.uint32)
    twister.state = {"bit_generator": "MT19937", "state": {"key": words, "pos": _MT_WORDS}}
    if high < _ONE_WORD_BELOW:
        return (twister.random_raw(count) % np.uint64(high)).astype(np.int64)
    pairs = twister.random_raw(2 * count).reshape(count, 2)
    wide = (pairs[:, 0] << np.uint64(32)) | pairs[:, 1]
    return (wide % np.uint64(high)).astype(np.int64)


_twisters = threading.local()


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed!r}")
