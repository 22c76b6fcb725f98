"""Opening a leased file under the data root (verify, map, page in): the prefetch thread's I/O."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from queue_client import errors
from queue_client.batchfile import BatchFile, load_batch_file
from queue_client.layout import DatasetLayout
from queue_client.wire import batchqueue_pb2 as pb

# Leased paths' directories resolved, by (data root, dataset, directory): every file of a
# split lies in one, and resolving a whole path walks each of its components (an lstat and
# some Python each, under the GIL, in the trainer's process) for every file.
_RESOLVED_DIRS: dict[tuple[Path, str, str], Path] = {}
_RESOLVED_DIRS_MAX = 256


def _within(root: Path, dataset: str, resolved: Path, leased: str) -> Path:
    """`resolved` if it lies in the data root, or in the dataset's own directory wherever
    that is (an operator may link it to another disk); PermissionDenied otherwise."""
    if resolved.is_relative_to(root) or resolved.is_relative_to((root / dataset).resolve()):
        return resolved
    raise errors.PermissionDenied(
        f"leased path {leased!r} lies outside the data root {root} and dataset {dataset!r}'s "
        "directory"
    )


def _leased_path(root: Path, dataset: str, leased: str) -> Path:
    """The leased file under `root`: its directory resolved (once) and checked to lie in the
    root or the dataset's directory; PermissionDenied where it does not."""
    directory, _, name = leased.rpartition("/")
    if name in ("", ".", ".."):
        return _within(root, dataset, (root / leased).resolve(), leased)
    key = (root, dataset, directory)
    resolved = _RESOLVED_DIRS.get(key)
    if resolved is None:
        resolved = _within(root, dataset, (root / directory).resolve(), leased)
        if len(_RESOLVED_DIRS) >= _RESOLVED_DIRS_MAX:
            _RESOLVED_DIRS.clear()
        _RESOLVED_DIRS[key] = resolved
    return resolved / name


def map_leased(
    root: Path, dataset: str, verify_checksums: bool, lease: pb.Lease
) -> tuple[str, BatchFile]:
    """Verify the leased file under data_root and map it: (its path, the file)."""
    path = _leased_path(root, dataset, lease.path)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):  # a link (the server makes none): followed, checked
            path = _within(root, dataset, path.resolve(), lease.path)
            st = path.stat()
        size = st.st_size
    except FileNotFoundError:
        if not DatasetLayout(root, dataset).meta_file.exists():
            # Not a bad file: this client looks in the wrong place. Nothing to quarantine.
            raise errors.InvalidRequest(
                f"{path} is not visible here: data_root {root} does not hold the server's "
                f"dataset {dataset!r}; pass QueueClient(data_root=...) or set "
                "BATCHQUEUE_DATA_ROOT to where the server's data root is mounted, or "
                'stream the files with transport="grpc" (or "auto")'
            ) from None
        raise errors.CorruptBatchFile(f"{path} is missing from the data root") from None
    if size != lease.size_bytes:
        raise errors.CorruptBatchFile(
            f"{path} has {size} bytes, the server wrote {lease.size_bytes}"
        )
    if not verify_checksums:
        page_in(path)
    return str(path), load_batch_file(path, crc32=lease.crc32 if verify_checksums else None)


def prefault(tensors: list[torch.Tensor]) -> None:
    """Read one element per page of each mapped tensor, here in the prefetch thread, so the
    trainer's first touch of a batch finds its pages mapped (no minor faults in get_batch).
    A file whose crc32 was checked needs none: the hash read every page through its map."""
    for t in tensors:
        flat = t.reshape(-1)
        step = max(1, 4096 // max(1, t.element_size()))
        flat[::step].to(torch.int64).sum()


def page_in(path: Path) -> None:
    """Ask the kernel to read the file ahead, so the first batches cost no I/O."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
