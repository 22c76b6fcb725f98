"""The token data every comparison shares: one text, read by the char_lm provider, and the very
same train-split ids written as nanoGPT's `train.bin` (uint16) for the baselines.

With `--text PATH` the text is that file (tinyshakespeare gives nanoGPT's shakespeare_char);
without it a seeded generator writes about 1 MB of word-like text, so the suite needs no
download. The ids follow char_lm's recipe: the sorted characters of the text, then the first
90% of the ids as train.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# char_lm's default train_fraction: the baselines read exactly the train ids the provider reads.
TRAIN_FRACTION = 0.9
_GENERATED_CHARS = 1_100_000
_QUICK_CHARS = 120_000


@dataclass(frozen=True)
class Tokens:
    text_path: Path
    train_bin: Path
    vocab_size: int
    train_tokens: int
    source: str


def prepare(text: Path | None, workdir: Path, quick: bool) -> Tokens:
    """Write train.bin (and the generated text, without --text) under workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    if text is None:
        text_path = workdir / "generated.txt"
        text_path.write_text(
            _generated_text(_QUICK_CHARS if quick else _GENERATED_CHARS), encoding="utf-8"
        )
        source = f"generated ({text_path.stat().st_size / 1e6:.1f} MB, seeded)"
    else:
        text_path = Path(text).expanduser().resolve()
        if not text_path.is_file():
            raise FileNotFoundError(f"--text {text}: no such file")
        source = f"{text_path.name} ({text_path.stat().st_size / 1e6:.1f} MB)"
    body = text_path.read_text(encoding="utf-8", errors="replace")
    chars = sorted(set(body))
    if len(chars) > np.iinfo(np.uint16).max:
        raise ValueError(f"{text_path} has {len(chars)} distinct characters; uint16 ids hold 65535")
    codepoints = np.frombuffer(body.encode("utf-32-le"), dtype=np.uint32)
    ids = np.searchsorted(np.array([ord(c) for c in chars], dtype=np.uint32), codepoints)
    train = ids[: int(len(ids) * TRAIN_FRACTION)].astype(np.uint16)
    train_bin = workdir / "train.bin"
    train.tofile(train_bin)
    return Tokens(text_path, train_bin, len(chars), len(train), source)


def _generated_text(n_chars: int) -> str:
    """Word-like text with a shakespeare-sized alphabet: letters, punctuation, newlines."""
    rng = np.random.default_rng(1337)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    words = ["".join(rng.choice(letters[:26], size=rng.integers(1, 9))) for _ in range(3000)]
    words += [w.capitalize() for w in words[:500]]
    seps = np.array([" "] * 12 + [", ", ". ", "; ", "! ", "? ", ":\n", "\n", "\n\n"])
    out: list[str] = []
    total = 0
    while total < n_chars:
        picks = rng.integers(0, len(words), size=4096)
        glue = rng.choice(seps, size=4096)
        chunk = "".join(words[i] + g for i, g in zip(picks, glue, strict=True))
        out.append(chunk)
        total += len(chunk)
    return "".join(out)[:n_chars]
