"""Where a leased file lies under the data root, checked to stay within it (or within the
dataset's own directory, wherever an operator linked it): no path from a lease leaves them.
Without torch, for the fetch helper as for the client's own fetches."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from queue_client import errors
from queue_client.format.layout import DatasetLayout
from queue_client.wire import batchqueue_pb2 as pb

# Leased paths' directories resolved, by (data root, dataset, directory): every file of a
# split lies in one, and resolving a whole path walks each of its components (an lstat and
# some Python each, under the GIL, in the trainer's process) for every file.
_RESOLVED_DIRS: dict[tuple[Path, str, str], Path] = {}
_RESOLVED_DIRS_MAX = 256


def within(root: Path, dataset: str, resolved: Path, leased: str) -> Path:
    """`resolved` if it lies in the data root, or in the dataset's own directory wherever
    that is (an operator may link it to another disk); PermissionDenied otherwise."""
    if resolved.is_relative_to(root) or resolved.is_relative_to((root / dataset).resolve()):
        return resolved
    raise errors.PermissionDenied(
        f"leased path {leased!r} lies outside the data root {root} and dataset {dataset!r}'s "
        "directory"
    )


def leased_path(root: Path, dataset: str, leased: str) -> Path:
    """The leased file under `root`: its directory resolved (once) and checked to lie in the
    root or the dataset's directory; PermissionDenied where it does not."""
    directory, _, name = leased.rpartition("/")
    if name in ("", ".", ".."):
        return within(root, dataset, (root / leased).resolve(), leased)
    key = (root, dataset, directory)
    resolved = _RESOLVED_DIRS.get(key)
    if resolved is None:
        resolved = within(root, dataset, (root / directory).resolve(), leased)
        if len(_RESOLVED_DIRS) >= _RESOLVED_DIRS_MAX:
            _RESOLVED_DIRS.clear()
        _RESOLVED_DIRS[key] = resolved
    return resolved / name


def leased_file(root: Path, dataset: str, lease: pb.Lease) -> Path:
    """The leased file under `root`, checked: within the root, of the size the lease says.
    A file missing where the dataset itself is missing is this client looking in the wrong
    place (InvalidRequest, nothing to quarantine); else CorruptBatchFile."""
    path = leased_path(root, dataset, lease.path)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):  # a link (the server makes none): followed, checked
            path = within(root, dataset, path.resolve(), lease.path)
            st = path.stat()
    except FileNotFoundError:
        if not DatasetLayout(root, dataset).meta_file.exists():
            raise errors.InvalidRequest(
                f"{path} is not visible here: data_root {root} does not hold the server's "
                f"dataset {dataset!r}; pass QueueClient(data_root=...) or set "
                "BATCHQUEUE_DATA_ROOT to where the server's data root is mounted, or "
                'stream the files with transport="grpc" (or "auto")'
            ) from None
        raise errors.CorruptBatchFile(f"{path} is missing from the data root") from None
    if st.st_size != lease.size_bytes:
        raise errors.CorruptBatchFile(
            f"{path} has {st.st_size} bytes, the server wrote {lease.size_bytes}"
        )
    return path
