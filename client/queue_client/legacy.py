"""Reading batch files that nanoGPT-style prepare.py scripts wrote, with no server at all.

`{data_dir}/{split}_batches_*.pt` files, each a dict with x and y tensors of shape
[num_samples, block_size]. Files are read in name order and cycled; batches are contiguous
slices, and a short last batch is filled by repeating samples from the file's start, as the
BatchManager these files were made for did.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from queue_client.errors import CorruptBatchFile, MetaError, UnknownSplit
from queue_client.format.layout import META_FILE
from queue_client.format.meta import load_meta
from queue_client.streaming.transfer import Transfer


class LegacyClient:
    """get_batch(split) over legacy files; meta comes from meta.pkl when present."""

    def __init__(
        self,
        data_dir: str | Path,
        batch_size: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.data_dir = Path(data_dir)
        if not self.data_dir.is_dir():
            raise MetaError(f"legacy data dir {self.data_dir} does not exist")
        meta_path = self.data_dir / META_FILE  # nanoGPT names its meta as we do
        self.meta: dict[str, Any] = load_meta(meta_path) if meta_path.exists() else {}
        size = batch_size if batch_size is not None else self.meta.get("batch_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise MetaError(
                f"batch_size is needed: pass batch_size=..., or put it in {meta_path} (got {size!r})"
            )
        self.batch_size = size
        self._transfer = Transfer(device)
        self._state: dict[str, dict[str, Any]] = {}

    def files(self, split: str) -> list[Path]:
        return sorted(self.data_dir.glob(f"{split}_batches_*.pt"))

    def _load(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            payload = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise CorruptBatchFile(f"{path}: cannot be loaded safely: {exc}") from None
        tensors = payload.get("tensors", payload) if isinstance(payload, dict) else None
        if not isinstance(tensors, dict) or "x" not in tensors or "y" not in tensors:
            raise CorruptBatchFile(f"{path}: expected a dict with tensors 'x' and 'y'")
        x, y = tensors["x"], tensors["y"]
        if (
            not isinstance(x, torch.Tensor)
            or not isinstance(y, torch.Tensor)
            or x.dim() < 1
            or y.dim() < 1
        ):
            raise CorruptBatchFile(f"{path}: 'x' and 'y' must be tensors with a sample axis")
        if x.shape[0] != y.shape[0] or x.shape[0] == 0:
            raise CorruptBatchFile(f"{path}: x has {x.shape[0]} samples, y has {y.shape[0]}")
        return x, y

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        st = self._state.get(split)
        if st is None:
            files = self.files(split)
            if not files:
                raise UnknownSplit(f"no {split}_batches_*.pt files in {self.data_dir}")
            st = self._state[split] = {"files": files, "index": -1, "x": None, "y": None, "pos": 0}
        if st["x"] is None or st["pos"] >= st["x"].shape[0]:
            st["index"] = (st["index"] + 1) % len(st["files"])
            st["x"], st["y"] = self._load(st["files"][st["index"]])
            st["pos"] = 0
        x, y, pos, b = st["x"], st["y"], st["pos"], self.batch_size
        n = x.shape[0]
        end = pos + b
        if end <= n:
            bx, by = x[pos:end], y[pos:end]
        else:
            # Repeat-to-fill: the short last batch takes samples from the file's start.
            idx = torch.arange(pos, end) % n
            bx, by = x[idx], y[idx]
        st["pos"] = end
        out = self._transfer([bx, by])
        return out[0], out[1]
