"""Token corpora in each format token_shards reads, written from their descriptions."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

LLMC_MAGIC = 20240520


def write_raw(path: Path, ids: np.ndarray) -> Path:
    ids.tofile(path)
    return path


def write_llmc(path: Path, ids: np.ndarray, *, magic: int = LLMC_MAGIC, version: int = 1) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, len(ids))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype="<u2").tobytes())
    return path


def write_megatron(prefix: Path, documents: list[np.ndarray], dtype_code: int = 8) -> Path:
    """PREFIX.bin and PREFIX.idx, one sequence per document; returns the .bin."""
    dtype = {8: np.dtype("<u2"), 4: np.dtype("<i4")}[dtype_code]
    lengths = np.array([len(d) for d in documents], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * dtype.itemsize
    doc_index = np.arange(len(documents) + 1, dtype="<i8")
    bin_path = prefix.with_suffix(".bin")
    np.concatenate(documents).astype(dtype).tofile(bin_path)
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(
            struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, dtype_code, len(lengths), len(doc_index))
        )
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_index.tobytes())
    return bin_path


def write_prepared(
    directory: Path, shards: list[list[np.ndarray]], *, vocab_size: int, eos_id: int = 0
) -> Path:
    """A prepared corpus: each shard a list of documents; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, docs in enumerate(shards):
        ids = np.concatenate(docs).astype(np.uint16)
        name = f"shard-{i:06d}.npy"
        np.save(directory / name, ids)
        starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]]).astype(np.int64)
        np.save(directory / f"shard-{i:06d}.docs.npy", starts)
        entries.append(
            {
                "file": name,
                "tokens": len(ids),
                "documents": len(docs),
                "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest(),
            }
        )
    manifest = {
        "format": "batchqueue-token-shards",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": {"name": "test"},
        "shards": entries,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def write_npy_bad(directory: Path) -> Path:
    """A .npy of Python objects (a pickle inside): must be refused before it is read."""
    path = directory / "x.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    return path
