"""Recording where a mixture source's epochs start, by the process that publishes the file.

The worker (or Ray actor) that makes a mixture file names, in the EncodedBatchFile it
returns, each source epoch whose first row the file holds; the process that owns the data
root (a worker process, or the server for a Ray actor, whose node may not share the server's
filesystem) records them beside the queue (queue_client/format/mixture_epochs.py) and logs each one
the first time. A file made again finds its records and logs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from queue_client.format.layout import DatasetLayout
from queue_client.format.mixture_epochs import record_epoch_start

log = logging.getLogger("queue_server.mixture")


def record_epoch_starts(
    layout: DatasetLayout, split: str, seq: int, epoch_starts: Iterable[tuple[str, int, int]]
) -> None:
    """Record, and log the first time, each source epoch that starts in file `seq`'s rows
    ((source, epoch, row) each, from its EncodedBatchFile or PublishedFile). Stats only: a
    record that cannot be written is a warning, never a failed file."""
    for source, epoch, row in epoch_starts:
        try:
            if not record_epoch_start(layout, split, source, epoch, row):
                continue
        except OSError as exc:
            log.warning("dataset %s: cannot record an epoch start: %s", layout.dataset, exc)
        log.info(
            "dataset %s split %s: source %s starts epoch %d (its row %d, in file seq %d)",
            layout.dataset,
            split,
            source,
            epoch,
            row,
            seq,
        )
