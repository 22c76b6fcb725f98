"""Batch file format versions 1 and 2: a torch.save zip holding one dict (FORMAT.md, legacy).

Datasets built before version 3 keep writing these, byte for byte as before, and every reader
keeps loading them: `torch.load(mmap=True, weights_only=True)`, whose restricted unpickler
builds tensors and plain data only, so nothing in a file can run code.
"""

from __future__ import annotations

import errno
import io
import pickle
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from queue_client.errors import CorruptBatchFile

if TYPE_CHECKING:
    import torch


def encode(
    format_name: str,
    version: int,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    extras: Mapping[str, torch.Tensor] | None,
) -> bytes:
    """The bytes of a version 1 or 2 file; the same arguments give the same bytes."""
    import torch

    payload = {
        "format": format_name,
        "version": version,
        "metadata": dict(metadata),
        "tensors": {k: v.contiguous() for k, v in tensors.items()},
    }
    if extras:
        payload["extras"] = {k: v.contiguous() for k, v in extras.items()}
    buf = io.BytesIO()
    torch.save(payload, buf, pickle_module=_CANONICAL_PICKLE)
    return buf.getvalue()


class _CanonicalPickler(pickle.Pickler):
    """A pickler without a memo: equal metadata pickles to equal bytes whether or not its
    strings and dicts happen to be shared objects (a plain pickler writes a back-reference for
    the second use of one object, so the bytes would depend on how the metadata was built)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = True  # no memo; batch payloads hold no cycles


# torch.save takes a pickle module and uses its Pickler.
_CANONICAL_PICKLE = types.ModuleType("queue_client.format.batchfile.canonical_pickle")
_CANONICAL_PICKLE.Pickler = _CanonicalPickler  # type: ignore[attr-defined]


def load_path(path: Path) -> object:
    """The payload of a file, mapped copy-on-write (torch's mmap is MAP_PRIVATE)."""
    import torch

    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise
    except Exception as exc:
        if not path.exists():  # gone (a consumed file deleted): torch's own open says RuntimeError
            raise FileNotFoundError(errno.ENOENT, "no such batch file", str(path)) from None
        raise CorruptBatchFile(f"{path}: cannot be loaded: {type(exc).__name__}: {exc}") from None


def load_bytes(data: bytes, where: str) -> object:
    """The payload of a file held in memory; its tensors are copies."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CorruptBatchFile(f"{where}: cannot be loaded: {type(exc).__name__}: {exc}") from None
