"""Where a mixture source's epochs start: the on-disk record, writer and reader together.

The worker that makes the mixture file holding a source's first row of an epoch (past the
first) creates an empty file `<source>.epoch<E>.row<P>` in `stats/<split>.epochs/` of the
dataset dir: source's row P (in its own stream) starts its epoch E. The server counts a
source's epochs from them (GetStats `epochs`). A row's epoch is a fact of the source's own
stream, the same whoever makes the file and however often, so the record needs no journal:
creating a name is atomic, and a name made twice is the same name.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from queue_client.layout import DatasetLayout, check_split_name, fsync_dir

_NAME = re.compile(r"(?P<source>.+)\.epoch(?P<epoch>[0-9]{1,9})\.row(?P<row>[0-9]{1,18})")


def epochs_dir(layout: DatasetLayout, split: str) -> Path:
    return layout.stats_dir / f"{check_split_name(split)}.epochs"


def record_epoch_start(directory: Path, source: str, epoch: int, row: int) -> None:
    """Source `source`'s row `row` starts its epoch `epoch` (an empty file by that name)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{source}.epoch{int(epoch)}.row{int(row)}"
    if path.exists():
        return
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    fsync_dir(directory)


def read_epoch_starts(directory: Path) -> dict[str, dict[int, int]]:
    """Each source's recorded epoch starts: {source: {epoch: row}} (empty when none)."""
    out: dict[str, dict[int, int]] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(directory):
            found = _NAME.fullmatch(entry)
            if found is not None:
                epochs = out.setdefault(found["source"], {})
                epochs[int(found["epoch"])] = int(found["row"])
    return out


def epoch_at(starts: dict[int, int], rows: int) -> int:
    """The epoch of a source's row `rows - 1`: the last epoch that starts before `rows`
    (0 when none does, or no row was served)."""
    return max((epoch for epoch, row in starts.items() if row < rows), default=0)
