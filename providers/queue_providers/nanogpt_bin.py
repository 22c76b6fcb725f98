"""nanogpt_bin: serve an existing nanoGPT dataset directory as it is.

nanoGPT's prepare.py scripts write `train.bin` and `val.bin` (token ids, uint16) and, for
character-level sets, `meta.pkl` (vocab_size, stoi, itos). This provider reads those files
unchanged and serves what nanoGPT's get_batch would: random windows, x = data[i:i+T] and
y = data[i+1:i+1+T] as int64. A batch file stores each window of T+1 tokens once, in the .bin
file's own dtype (uint16, or uint32 past 65,536 ids). Each .bin is memory-mapped once per process and windows are
gathered from that map; nanoGPT re-opens the map every batch, which costs a syscall per batch
and buys nothing here since the gathered windows are copies.

Files are made with numpy alone (the window starts torch's generator would draw, drawn by
seeding.randint_draws), so a worker of a nanogpt_bin dataset never imports torch;
sample_batch, the base class's way, still does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from queue_client.errors import ConfigError
from queue_client.format.batchfile import EncodedBatchFile
from queue_client.format.meta import loads_plain
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.compact import lm_window_schema
from queue_providers.inputs import Input
from queue_providers.provenance import check_rows, window_rows
from queue_providers.remote import RemotePath, input_path, local_file, store_for
from queue_providers.seeding import derive_seed, randint_draws

if TYPE_CHECKING:
    import torch

_INT64 = np.dtype(np.int64)

# What nanoGPT's openwebtext and shakespeare (BPE) sets hold when they have no meta.pkl.
GPT2_VOCAB_SIZE = 50257


def token_dtype(vocab_size: int) -> np.dtype:
    """nanoGPT's choice: uint16 while every id fits, uint32 beyond."""
    return np.dtype(np.uint32 if vocab_size > 65535 else np.uint16)


def read_nanogpt_meta(path: Path | RemotePath) -> dict[str, Any]:
    """nanoGPT's meta.pkl, read as plain data only (no code runs while loading it)."""
    try:
        meta = loads_plain(path.read_bytes())
    except Exception as exc:
        raise ConfigError(f"{path} is not a plain-data pickle of nanoGPT's meta: {exc}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} holds a {type(meta).__name__}; nanoGPT's meta.pkl is a dict")
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise ConfigError(f"{path}: vocab_size is {vocab_size!r}, expected a positive int")
    return meta


class NanoGPTBinProvider(DataProviderBase):
    """Random windows of a nanoGPT token file per split."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        data_dir: str,
        block_size: int = 1024,
        vocab_size: int | None = None,
        splits: Sequence[str] = ("train", "val"),
        remote: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ConfigError(f"nanogpt_bin: block_size must be a positive int, got {block_size!r}")
        if isinstance(splits, str) or not splits:
            raise ConfigError(
                f"nanogpt_bin: splits must be a non-empty list of names, got {splits!r}"
            )
        # A path, or a URL (queue_providers.remote): each .bin is then copied into the input
        # cache once, to be memory-mapped like a local one.
        store = store_for(remote, context.layout.input_cache_dir, "nanogpt_bin")
        self.data_dir = input_path(data_dir, store)
        if not self.data_dir.is_dir():
            raise ConfigError(f"nanogpt_bin: data_dir {str(self.data_dir)!r} is not a directory")
        self.block_size = block_size
        self.nanogpt_meta: dict[str, Any] = {}
        meta_path = self.data_dir / "meta.pkl"
        if meta_path.is_file():
            self.nanogpt_meta = read_nanogpt_meta(meta_path)
            found = self.nanogpt_meta["vocab_size"]
            if vocab_size is not None and vocab_size != found:
                raise ConfigError(
                    f"nanogpt_bin: vocab_size={vocab_size} in config but {meta_path} says {found}"
                )
            vocab_size = found
        elif vocab_size is None:
            vocab_size = GPT2_VOCAB_SIZE
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
            raise ConfigError(f"nanogpt_bin: vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.paths: dict[str, Path | RemotePath] = {}
        self.tokens: dict[str, int] = {}
        for split in splits:
            path = self.data_dir / f"{split}.bin"
            self.paths[split], self.tokens[split] = path, self._count_tokens(path)
        copies = [p.object() for p in self.paths.values() if isinstance(p, RemotePath)]
        if copies:  # every split is memory-mapped at once: their local copies must fit together
            store.check_room(copies, "nanogpt_bin")
        self._maps: dict[str, np.memmap] = {}

    def _count_tokens(self, path: Path | RemotePath) -> int:
        if not path.is_file():
            raise ConfigError(
                f"nanogpt_bin: {path} is missing (each split needs SPLIT.bin in data_dir)"
            )
        size = path.stat().st_size
        if size % self.dtype.itemsize:
            raise ConfigError(
                f"nanogpt_bin: {path} is {size} bytes, not a multiple of {self.dtype.itemsize} "
                f"({self.dtype.name} tokens, since vocab_size={self.vocab_size}); the file is "
                "truncated or was written with another dtype"
            )
        n = size // self.dtype.itemsize
        if n <= self.block_size:
            raise ConfigError(
                f"nanogpt_bin: {path} holds {n} tokens, fewer than block_size+1={self.block_size + 1}"
            )
        return n

    def input_files(self) -> Sequence[Input]:
        """Each split's .bin and nanoGPT's meta.pkl (its vocab), not the rest of data_dir."""
        meta_path = self.data_dir / "meta.pkl"
        return [*self.paths.values(), *([meta_path] if meta_path.is_file() else [])]

    def build_meta(self) -> dict[str, Any]:
        t = self.block_size
        meta: dict[str, Any] = {
            "training_type": "LM",
            "vocab_size": self.vocab_size,
            "block_size": t,
            "source": str(self.data_dir),
            "token_dtype": self.dtype.name,
            "batch_schema": lm_window_schema(t, self.vocab_size),
            "split_info": {
                split: {"tokens": n, "file": self.paths[split].name}
                for split, n in self.tokens.items()
            },
        }
        for key in ("stoi", "itos"):
            if isinstance(self.nanogpt_meta.get(key), Mapping):
                meta[key] = dict(self.nanogpt_meta[key])
        return meta

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        for split in self.paths:
            self.data(split)

    def data(self, split: str) -> np.memmap:
        """The split's tokens, mapped once per process."""
        mm = self._maps.get(split)
        if mm is None:
            local = local_file(self.paths[split])
            mm = self._maps[split] = np.memmap(local, dtype=self.dtype, mode="r")
        return mm

    def window_starts(self, split: str, rng: torch.Generator) -> torch.Tensor:
        """batch_size offsets drawn uniformly from [0, tokens - block_size), as nanoGPT does."""
        import torch

        return torch.randint(
            self.tokens[split] - self.block_size, (self.batch_size,), generator=rng
        )

    def rows(
        self, split: str, starts: np.ndarray | torch.Tensor, dtype: np.dtype = _INT64
    ) -> np.ndarray:
        """The windows of T+1 ids starting at `starts`, in `dtype`, each copied from the map
        in one piece; ValueError naming the file if an id is not below vocab_size."""
        index = starts if isinstance(starts, np.ndarray) else starts.numpy()
        rows = sliding_window_view(self.data(split), self.block_size + 1)[index]
        top = int(rows.max())
        if top >= self.vocab_size:
            raise ValueError(
                f"nanogpt_bin: {self.paths[split]} holds token id {top} >= vocab_size {self.vocab_size}"
            )
        return np.asarray(rows, dtype=dtype)

    def windows(self, split: str, starts: torch.Tensor) -> dict[str, torch.Tensor]:
        """x and y (int64) for windows starting at `starts`."""
        import torch

        windows = torch.from_numpy(self.rows(split, starts))
        return {"x": windows[:, :-1], "y": windows[:, 1:]}

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        return self.windows(split, self.window_starts(split, rng))

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        """The file the base class makes from sample_batch, byte for byte, without widening:
        the same window starts (file_rng's, drawn without torch), gathered from the map
        straight into the stored window (format 2 and later), at a fraction of the CPU of
        int64 x and y stacked, checked and narrowed again."""
        windows = self.file_windows(split, seq)
        if windows is None:
            return super().make_file(split, seq)
        return self.encode_windows(split, seq, windows)

    def file_windows(self, split: str, seq: int) -> np.ndarray | None:
        dtype = self.window_dtype(split)
        if dtype is None:
            return None
        n, b, t = self.context.batches_per_file, self.batch_size, self.block_size
        seed = derive_seed(self.context.seed, split, seq)  # file_rng's
        starts = randint_draws(seed, self.tokens[split] - t, n * b)
        return self.rows(split, starts, dtype).reshape(n, b, t + 1)

    def provenance(self, split: str, seq: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Each row's start in SPLIT.bin: file_windows's draws, no token read."""
        if split not in self.paths:
            raise ValueError(
                f"nanogpt_bin: no split {split!r}; the splits are {sorted(self.paths)}"
            )
        n, b, t = self.context.batches_per_file, self.batch_size, self.block_size
        at = check_rows(rows, n * b, f"nanogpt_bin split {split!r} seq {seq}")
        starts = randint_draws(
            derive_seed(self.context.seed, split, seq), self.tokens[split] - t, n * b
        )
        return window_rows(
            [str(self.paths[split])], [None], np.zeros(len(at), np.int64), starts[at]
        )
