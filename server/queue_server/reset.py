"""`queue-server reset DATASET`: set a dataset dir aside so that the next start rebuilds it.

A dataset dir is built once and then only checked: a changed input, tokenizer or config makes
the server refuse it (dataset.py). Rebuilding is a deliberate act, so it is a command of its
own. It holds the data root's lock while it works, so it refuses while a server runs there
and no server can start halfway through. The dir is renamed in one step to
`<dataset>.reset-<utc>` in the same data root, so meta, journals, caches and batch files all
go together and nothing stale is left under the dataset's name. Nothing is deleted unless
asked: with `delete`, the dir is renamed aside first and removed after, so a crash in the
middle never leaves half a dataset under its live name.

A dataset dir that is a symbolic link (the data kept on another disk) is refused before
anything changes: renaming moves the link, not the data, so the rebuild would land under the
data root instead of where the link pointed, and a delete would have to choose between the
link and the data behind it. The message names the link and its target, and what to do.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from queue_client.errors import InvalidRequest
from queue_client.format.layout import DatasetLayout, fsync_dir
from queue_server.host.root_lock import DataRootLock


class NothingToReset(Exception):
    """The dataset has no directory under the data root: it was never built there."""


@dataclass(frozen=True)
class ResetDone:
    dataset_dir: Path
    moved_to: Path
    deleted: bool


def reset_dataset(data_root: Path, dataset: str, *, delete: bool = False) -> ResetDone:
    """Move `dataset`'s dir aside (and delete it with `delete`).

    Raises ConfigError (from DataRootLock) naming the pid while a server holds the data root,
    InvalidRequest for a name that could leave the root or a dir that is a symbolic link,
    NothingToReset when there is no dir.
    """
    layout = DatasetLayout(Path(data_root), dataset)
    _refuse_a_link(layout.dir, dataset)
    if not layout.dir.is_dir():
        raise NothingToReset(f"nothing to reset: {layout.dir} does not exist")
    lock = DataRootLock(layout.root)
    lock.acquire()
    try:
        _refuse_a_link(layout.dir, dataset)  # again, under the lock: nothing changed yet
        aside = _free_reset_dir(layout)
        os.rename(layout.dir, aside)
        fsync_dir(layout.root)
        if delete:
            shutil.rmtree(aside)
    finally:
        lock.release()
    return ResetDone(layout.dir, aside, delete)


def _refuse_a_link(path: Path, dataset: str) -> None:
    if not path.is_symlink():
        return
    target = os.readlink(path)
    where = Path(path.parent, target).resolve()
    raise InvalidRequest(
        f"{path} is a symbolic link to {target}"
        + (f" ({where})" if str(where) != target else "")
        + (" (which does not exist)" if not where.exists() else "")
        + f"; reset moves and deletes dataset directories, never what a link points to, so "
        f"nothing was changed. To rebuild dataset {dataset!r} where the link points, move "
        f"that directory's contents aside (or delete them) yourself and leave it empty; to "
        f"rebuild it under the data root instead, remove the link"
    )


def _free_reset_dir(layout: DatasetLayout) -> Path:
    """`<dataset>.reset-<utc>`, numbered when a reset in the same second took that name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidate = layout.reset_dir(stamp)
    n = 1
    while candidate.exists():
        candidate = layout.reset_dir(f"{stamp}-{n}")
        n += 1
    return candidate
