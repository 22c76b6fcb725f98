"""Where a leased file lies under the data root, checked to stay within it (or within the
dataset's own directory, wherever an operator linked it): no path from a lease leaves them.
Without torch, for the fetch helper as for the client's own fetches."""

from __future__ import annotations

from pathlib import Path

from queue_client import errors

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
