"""char_lm: nanoGPT's shakespeare_char as a provider.

The vocabulary is every character of the text (sorted), the first `train_fraction` of the
text is train and the rest val, and each batch is `batch_size` random windows of block_size+1
characters split into x and y. A file stores each window once, in uint16 (uint32 past 65,536
characters): x and y are its two views. With no `input`, the text is the source of Python's own standard
library, which exists wherever Python does, so the default dataset needs no download.

Files are made with numpy alone (the window starts torch's generator would draw, drawn by
seeding.randint_draws), so a worker of a char_lm dataset never imports torch; sample_batch,
the base class's way, still does.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from queue_client.errors import ConfigError
from queue_client.format.batchfile import EncodedBatchFile
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.compact import lm_window_schema
from queue_providers.inputs import Input
from queue_providers.provenance import check_rows, window_rows
from queue_providers.remote import read_text, resolve, shown, store_for
from queue_providers.seeding import derive_seed, randint_draws

if TYPE_CHECKING:
    import torch

# The first stdlib modules in sorted order, up to this many characters: big enough to train
# a tiny model, small enough to load in well under a second.
STDLIB_TEXT_CHARS = 2_000_000


def stdlib_text(max_chars: int = STDLIB_TEXT_CHARS) -> str:
    """Deterministic text from the running Python's standard library sources."""
    return stdlib_corpus(max_chars)[0]


def stdlib_corpus(max_chars: int = STDLIB_TEXT_CHARS) -> tuple[str, list[Path]]:
    """stdlib_text and the files it was read from: another Python's standard library is
    another corpus (another vocab), so those files are the dataset's inputs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    files: list[Path] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        files.append(path)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if not text:
        raise ConfigError(f"no readable .py files under the standard library at {root}")
    return text, files


class CharLMProvider(DataProviderBase):
    """Random windows of a character-level corpus, x = chars[i:i+T], y = chars[i+1:i+T+1]."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        block_size: int = 256,
        input: str | None = None,
        train_fraction: float = 0.9,
        remote: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 < train_fraction < 1.0:
            raise ConfigError(f"train_fraction must lie in (0, 1), got {train_fraction!r}")
        self.block_size = block_size
        self._inputs: Sequence[Input]
        if input is None:
            (text, self._inputs), self.source = stdlib_corpus(), "python-stdlib"
            self._fixed = False
        else:
            # A path, or a URL (queue_providers.remote): read whole, through the input cache.
            store = store_for(remote, context.layout.input_cache_dir, "char_lm")
            path = resolve(input, store)
            if isinstance(path, Path) and not path.is_file():
                raise ConfigError(f"char_lm input {str(path)!r} is not a file")
            text, self.source = read_text(path), shown(path)
            self._inputs = [path]
            self._fixed = isinstance(path, Path)  # not an object at a URL
        # The vocabulary is the text's code points in order: one count per code point and a
        # cumulative sum give every char's id (a few ms for a MB, where set() and a search
        # took 35: every worker does this at its start).
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        present = np.bincount(codepoints) > 0
        chars = [chr(c) for c in np.flatnonzero(present)]
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = dict(enumerate(chars))
        ids = (np.cumsum(present) - 1)[codepoints]
        n_train = int(len(ids) * train_fraction)
        self.data = {
            "train": ids[:n_train].astype(np.int64),
            "val": ids[n_train:].astype(np.int64),
        }
        for split, data in self.data.items():
            if len(data) <= block_size:
                raise ConfigError(
                    f"char_lm {split} split has {len(data)} characters, fewer than block_size+1="
                    f"{block_size + 1}: use more text or a smaller block_size"
                )
        self._offsets = np.arange(block_size + 1)
        self._narrow: dict[tuple[str, str], np.ndarray] = {}  # ids in a stored dtype

    def input_files(self) -> Sequence[Input]:
        """The text file, or the standard library files the default text was read from."""
        return list(self._inputs)

    def fixed_inputs(self) -> bool:
        """The text file a local path names (the standard library's files are a listing)."""
        return self._fixed

    def build_meta(self) -> dict[str, Any]:
        t = self.block_size
        return {
            "training_type": "LM",
            "vocab_size": len(self.stoi),
            "block_size": t,
            "stoi": self.stoi,
            "itos": self.itos,
            "source": self.source,
            "batch_schema": lm_window_schema(t, len(self.stoi)),
            "split_info": {split: {"tokens": len(d)} for split, d in self.data.items()},
        }

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        import torch

        data = self.data[split]
        starts = torch.randint(len(data) - self.block_size, (self.batch_size, 1), generator=rng)
        windows = torch.from_numpy(data[starts.numpy() + self._offsets])
        return {"x": windows[:, :-1], "y": windows[:, 1:]}  # stacked into the file as they are

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        """The file the base class makes from sample_batch, byte for byte, without widening:
        the same window starts, gathered from the text's narrow ids into the stored window
        (format 2 and later). The base's way (int64 x and y, stacked, checked, narrowed
        again) cost about five times the CPU. Every id is a character of stoi by
        construction, so there is nothing to check. The starts are the ones file_rng's
        generator draws, drawn without torch (seeding.randint_draws)."""
        windows = self.file_windows(split, seq)
        if windows is None:
            return super().make_file(split, seq)
        return self.encode_windows(split, seq, windows)

    def file_windows(self, split: str, seq: int) -> np.ndarray | None:
        dtype = self.window_dtype(split)
        if dtype is None:
            return None
        narrow = self._narrow.get((split, dtype.str))
        if narrow is None:
            narrow = self._narrow[split, dtype.str] = self.data[split].astype(dtype)
        n, b, t = self.context.batches_per_file, self.batch_size, self.block_size
        seed = derive_seed(self.context.seed, split, seq)  # file_rng's
        starts = randint_draws(seed, len(narrow) - t, n * b)
        # Rows of a view of every window: one contiguous copy per window, where an index of
        # every id (n*b*(T+1) int64s) cost 20x the time.
        windows = sliding_window_view(narrow, t + 1)[starts]
        return windows.reshape(n, b, t + 1)

    def provenance(self, split: str, seq: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Each row's first character in the input text (val follows train in it): the
        draws file_windows makes, no character read."""
        if split not in self.data:
            raise ValueError(f"char_lm: no split {split!r}; the splits are {sorted(self.data)}")
        n, b, t = self.context.batches_per_file, self.batch_size, self.block_size
        at = check_rows(rows, n * b, f"char_lm split {split!r} seq {seq}")
        seed = derive_seed(self.context.seed, split, seq)  # file_rng's
        starts = randint_draws(seed, len(self.data[split]) - t, n * b)[at]
        if split == "val":
            starts = starts + len(self.data["train"])
        return window_rows([self.source], [None], np.zeros(len(at), np.int64), starts)
