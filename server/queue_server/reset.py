"""`queue-server reset DATASET`: set a dataset dir aside so that the next start rebuilds it.

A dataset dir is built once and then only checked: a changed input, tokenizer or config makes
the server refuse it (dataset.py). Rebuilding is a deliberate act, so it is a command of its
own. It holds the data root's lock while it works, so it refuses while a server runs there
and no server can start halfway through. The dir is renamed in one step to
`<dataset>.reset-<utc>` in the same data root, so meta, journals, caches and batch files all
go together and nothing stale is left under the dataset's name. Nothing is deleted unless
asked: with `delete`, the dir is renamed aside first and removed after, so a crash in the
middle never leaves half a dataset under its live name.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from queue_client.layout import DatasetLayout, fsync_dir
from queue_server.root_lock import DataRootLock


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
    InvalidRequest for a name that could leave the root, NothingToReset when there is no dir.
    """
    layout = DatasetLayout(Path(data_root), dataset)
    if not layout.dir.is_dir():
        raise NothingToReset(f"nothing to reset: {layout.dir} does not exist")
    lock = DataRootLock(layout.root)
    lock.acquire()
    try:
        aside = _free_reset_dir(layout)
        os.rename(layout.dir, aside)
        fsync_dir(layout.root)
        if delete:
            shutil.rmtree(aside)
    finally:
        lock.release()
    return ResetDone(layout.dir, aside, delete)


def _free_reset_dir(layout: DatasetLayout) -> Path:
    """`<dataset>.reset-<utc>`, numbered when a reset in the same second took that name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidate = layout.reset_dir(stamp)
    n = 1
    while candidate.exists():
        candidate = layout.reset_dir(f"{stamp}-{n}")
        n += 1
    return candidate
