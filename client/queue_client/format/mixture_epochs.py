"""Where a mixture source's epochs start: the record's writer and reader (its name is
layout.py's: DatasetLayout.mixture_epoch_start_file).

The process that publishes the mixture file holding a source's first row of an epoch (past
the first; the file names it, EncodedBatchFile.epoch_starts) creates an empty file `<source>.epoch<E>.row<P>` in `stats/<split>.epochs/` of the
dataset dir: the source's row P (in its own stream) starts its epoch E. The server counts a
source's epochs from them (GetStats `epochs`). A row's epoch is a fact of the source's own
stream, the same whoever makes the file and however often, so the record needs no journal:
creating a name is atomic, and a name made twice is the same name.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from queue_client.format.layout import DatasetLayout, fsync_dir, mixture_epoch_start_of


def record_epoch_start(
    layout: DatasetLayout, split: str, source: str, epoch: int, row: int
) -> bool:
    """Source `source`'s row `row` starts its epoch `epoch` (an empty file by that name);
    False when it was recorded already (the file made again, or by another worker)."""
    path = layout.mixture_epoch_start_file(split, source, epoch, row)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    fsync_dir(path.parent)
    return True


def read_epoch_starts(directory: Path) -> dict[str, dict[int, int]]:
    """Each source's recorded epoch starts: {source: {epoch: row}} (empty when none)."""
    out: dict[str, dict[int, int]] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(directory):
            found = mixture_epoch_start_of(entry)
            if found is not None:
                source, epoch, row = found
                out.setdefault(source, {})[epoch] = row
    return out


def epoch_at(starts: dict[int, int], rows: int) -> int:
    """The epoch of a source's row `rows - 1`: the last epoch that starts before `rows`
    (0 when none does, or no row was served)."""
    return max((epoch for epoch, row in starts.items() if row < rows), default=0)
