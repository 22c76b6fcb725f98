"""Data roots across the change to format 3: a new dataset dir writes version 3 files, and
one whose meta records version 2 keeps serving its version 2 files and writing new ones in
version 2 after a restart, with the batches a version 3 root of the same config serves (the
format enters no fingerprint, so nothing is refused or rebuilt). A mixture and its sources
keep the format their meta records the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from conftest import char_config
from queue_client import QueueClient
from queue_client.format.batchfile import BatchFile, load_batch_bytes, load_batch_file, scan_queue
from queue_client.format.layout import DatasetLayout
from queue_client.format.meta import dump_meta, load_meta
from queue_providers import ProviderContext, create
from queue_server.testing import wait_until


def _on_disk(qdir: Path) -> dict[str, BatchFile]:
    """The published files of a queue dir now, loaded (one consumed meanwhile is skipped)."""
    out = {}
    for name in scan_queue(qdir):
        try:
            out[str(name)] = load_batch_file(qdir / str(name))
        except FileNotFoundError:
            continue
    return out


def _batches(c: QueueClient, n: int) -> list[torch.Tensor]:
    """n batches of x and y, as one [B, 2, T] tensor each (copies: the files may go)."""
    out = []
    for _ in range(n):
        x, y = c.get_batch("train")
        out.append(torch.stack([x, y], dim=1).clone())
    return out


def _file_batches(f: BatchFile) -> list[torch.Tensor]:
    t: Any = f.tensors
    return list(torch.stack([t["x"], t["y"]], dim=2).unbind(0))


def test_a_version_2_root_keeps_serving_and_writing_version_2(
    start_server, corpus: Path, tmp_path: Path
) -> None:
    config = char_config(corpus, batches_per_file=3)
    fresh = start_server(config, data_root=tmp_path / "fresh")
    fresh_layout = DatasetLayout(tmp_path / "fresh", "chars")
    with QueueClient(fresh.address, "chars") as c:
        want = _batches(c, 9)
    assert {f.version for f in _on_disk(fresh_layout.queue_dir("train")).values()} == {3}
    meta = load_meta(fresh_layout.meta_file)
    assert meta["batch_format_version"] == 3
    fresh.stop()

    # The same dataset as a batchqueue writing version 2 left it: meta.pkl says 2.
    old_layout = DatasetLayout(tmp_path / "old", "chars")
    old_layout.dir.mkdir(parents=True)
    dump_meta(old_layout.meta_file, {**meta, "batch_format_version": 2})
    old_layout.inputs_file.write_bytes(fresh_layout.inputs_file.read_bytes())
    qdir = old_layout.queue_dir("train")
    first = start_server(config, data_root=tmp_path / "old")
    wait_until(
        lambda: {0, 1} <= {f.metadata["seq"] for f in _on_disk(qdir).values()},
        timeout_s=120,
        what="the version 2 root's files 0 and 1",
    )
    first.stop()
    before = _on_disk(qdir)  # made by the first process, before the restart
    assert {f.version for f in before.values()} == {2}
    by_seq = {f.metadata["seq"]: f for f in before.values()}
    kept = _file_batches(by_seq[0]) + _file_batches(by_seq[1])

    again = start_server(config, data_root=tmp_path / "old")
    with QueueClient(again.address, "chars") as c:
        got = _batches(c, 9)
        made = wait_until(
            lambda: {n: f for n, f in _on_disk(qdir).items() if n not in before},
            timeout_s=120,
            what="a file made after the restart",
        )
    assert _equal(got[:6], kept)  # files 0 and 1, served as the first process wrote them
    assert _equal(got, want)  # the batches of the version 3 root
    assert {f.version for f in made.values()} == {2}
    assert load_meta(old_layout.meta_file)["batch_format_version"] == 2


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_mixture_keeps_the_format_its_meta_records(tmp_path: Path) -> None:
    """A mixture and its sources write the version their meta records: a new meta says 3;
    one from a version 2 root (top level and each source's meta) keeps 2, and both serve the
    same rows."""
    path = tmp_path / "tokens.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(path)
    args = {"inputs": [str(path)], "block_size": 4, "vocab_size": 300}
    sources = [
        {"name": name, "provider": "token_shards", "weight": 1.0, "args": args}
        for name in ("a", "b")
    ]
    context = ProviderContext("mix", tmp_path / "mix", 2, 3, seed=5)
    new = create("mixture", context, {"sources": sources})
    meta = new.complete_meta()
    assert meta["batch_format_version"] == 3
    assert {m["batch_format_version"] for m in meta["mixture"]["source_meta"]} == {3}
    new.set_meta(meta)
    old = create("mixture", context, {"sources": sources})
    source_meta = [{**m, "batch_format_version": 2} for m in meta["mixture"]["source_meta"]]
    old.set_meta(
        {
            **meta,
            "batch_format_version": 2,
            "mixture": {**meta["mixture"], "source_meta": source_meta},
        }
    )
    assert [p.format_version for p in old._providers] == [2, 2]
    for seq in range(3):
        got = load_batch_bytes(new.make_file("train", seq).data, "new")
        kept = load_batch_bytes(old.make_file("train", seq).data, "old")
        assert (got.version, kept.version) == (3, 2)
        for name, value in got.tensors.items():
            assert torch.equal(kept.tensors[name], value), (seq, name)
