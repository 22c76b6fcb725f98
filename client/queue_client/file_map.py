"""Opening a leased file under the data root (verify, map, page in): the prefetch thread's I/O."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from queue_client import errors
from queue_client.batchfile import BatchFile, load_batch_file
from queue_client.layout import DatasetLayout
from queue_client.lease_path import leased_path, within
from queue_client.wire import batchqueue_pb2 as pb


def map_leased(
    root: Path, dataset: str, verify_checksums: bool, lease: pb.Lease
) -> tuple[str, BatchFile]:
    """Verify the leased file under data_root and map it: (its path, the file)."""
    path = leased_path(root, dataset, lease.path)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):  # a link (the server makes none): followed, checked
            path = within(root, dataset, path.resolve(), lease.path)
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
