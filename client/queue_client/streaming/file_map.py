"""Opening a leased file under the data root (verify, map, page in): the prefetch thread's I/O."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from queue_client.format.batchfile import BatchFile, load_batch_file
from queue_client.streaming.lease_path import leased_file
from queue_client.wire import batchqueue_pb2 as pb


def map_leased(
    root: Path, dataset: str, verify_checksums: bool, lease: pb.Lease
) -> tuple[str, BatchFile]:
    """Verify the leased file under data_root and map it: (its path, the file)."""
    path = leased_file(root, dataset, lease)
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
