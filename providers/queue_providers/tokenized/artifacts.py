"""The tokenized arrays of a provider's inputs, cached under artifacts/<key>/ of its dataset.

build_meta tokenizes the corpus once and saves the arrays (one .npy each) and a JSON info
beside them; every worker then memory-maps them read-only, so worker processes share the page
cache instead of each tokenizing the corpus again. The key is a digest of everything the
arrays depend on, and meta["artifacts"] pins the one the batches were made from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from queue_client.errors import MetaError
from queue_client.format.layout import (
    DatasetLayout,
    artifact_array_file,
    artifact_info_file,
    atomic_directory,
    atomic_write,
)

Build = Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]


def file_identity(path: Path) -> tuple[str, int, int]:
    """What a cache key needs to notice that a file changed: its path, size and mtime."""
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def cache_key(kind: str, *parts: object) -> str:
    return f"{kind}-{hashlib.blake2b(repr(parts).encode(), digest_size=10).hexdigest()}"


def _npy_writer(arr: np.ndarray) -> Callable[[BinaryIO], None]:
    """A writer of one array as .npy, bound to that array (not to a loop variable)."""
    return lambda f: np.save(f, np.ascontiguousarray(arr))


def _save(directory: Path, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    for name, arr in arrays.items():
        atomic_write(artifact_array_file(directory, name), _npy_writer(arr))
    atomic_write(artifact_info_file(directory), json.dumps(info, sort_keys=True).encode())


def cached_arrays(
    layout: DatasetLayout, key: str, build: Build
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and info saved under artifacts/<key>, building and saving them if absent.

    Arrays come back memory-mapped read-only. The directory is filled under a temp name and
    renamed into place (layout.atomic_directory), so a reader never sees a half-written cache
    and two processes racing to build it both end with the same one.
    """
    final = layout.artifacts(key)
    if not final.is_dir():
        arrays, info = build()
        with atomic_directory(final) as tmp:
            if tmp is not None:
                _save(tmp, arrays, info)
    info = json.loads((artifact_info_file(final)).read_text())
    arrays = {p.stem: np.load(p, mmap_mode="r") for p in sorted(final.glob("*.npy"))}
    return arrays, info


def load_artifacts(
    layout: DatasetLayout, key_now: str, pinned: str | None, build: Build
) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    """(key, arrays, info) of a provider's cached inputs.

    build_meta passes pinned=None and gets the cache for the inputs as they are now (key_now);
    it records the key in meta["artifacts"]. Workers pass that key as `pinned` and load
    exactly what meta describes, even if an input file changed since. If the pinned cache is
    gone it is rebuilt, but only while the inputs still hash to it.
    """
    key = pinned or key_now
    if pinned and pinned != key_now and not layout.artifacts(pinned).is_dir():
        raise MetaError(
            f"{layout.artifacts(pinned)} is gone and the inputs changed since meta was built "
            f"(they now hash to {key_now}): restart the server so meta is built again"
        )
    arrays, info = cached_arrays(layout, key, build)
    return key, arrays, info
