"""The input cache never evicts a file in use, and says so when it cannot hold what a provider
needs at once: nanogpt_bin over a URL whose .bin files together exceed remote.cache_bytes is
refused at start naming the key and the sizes; with room enough, each file is downloaded once
however many providers (worker processes) map it and however many blocks pass through."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from support.object_http import ObjectServer

from conftest import subprocess_env
from queue_client.errors import ConfigError
from queue_providers import ProviderContext, create
from queue_providers.remote import RemoteSettings, RemoteStore

BLOCK = 4096
TOKENS = np.random.default_rng(0).integers(0, 65, 30_000, dtype=np.uint16)
FILES = {
    "nano/train.bin": TOKENS[:20_000].tobytes(),  # 40,000 bytes
    "nano/val.bin": TOKENS[20_000:].tobytes(),  # 20,000 bytes
    "nano/meta.pkl": pickle.dumps({"vocab_size": 65, "stoi": {chr(33 + i): i for i in range(65)}}),
    "other.jsonl": b"x" * 50_000,
}
NEED = len(FILES["nano/train.bin"]) + len(FILES["nano/val.bin"])


def gets(http: ObjectServer, name: str) -> int:
    return sum(1 for method, path, _ in http.requests if method == "GET" and path == f"/{name}")


def nanogpt(http: ObjectServer, workdir: Path, cache_bytes: int) -> object:
    ctx = ProviderContext("nano", workdir, batch_size=4)
    remote = {"cache_bytes": cache_bytes, "block_bytes": BLOCK}
    return create(
        "nanogpt_bin", ctx, {"data_dir": http.url("nano"), "block_size": 16, "remote": remote}
    )


def test_nanogpt_bin_is_refused_when_cache_bytes_cannot_hold_its_files_at_once(
    tmp_path: Path,
) -> None:
    """Each .bin fits alone but not both: the provider is refused before anything is copied,
    naming remote.cache_bytes, each file's size and the total to raise it to."""
    with ObjectServer(FILES) as http:
        with pytest.raises(ConfigError) as err:
            nanogpt(http, tmp_path / "nano", cache_bytes=NEED - 1)
        assert gets(http, "nano/train.bin") == gets(http, "nano/val.bin") == 0
    message = str(err.value)
    assert f"remote.cache_bytes = {NEED - 1} cannot hold" in message, message
    assert "train.bin (40000 bytes) + val.bin (20000 bytes)" in message, message
    assert f"at least {NEED}" in message, message


def test_copies_in_use_are_never_evicted_and_are_downloaded_once(tmp_path: Path) -> None:
    """cache_bytes = exactly the two .bin files: two providers over one cache (as two worker
    processes are) map both, then blocks of another object pass through the full cache. No
    copy in use is deleted, each .bin is fetched once, and batches come from the right bytes."""
    blocks = -(-len(FILES["nano/train.bin"]) // BLOCK), -(-len(FILES["nano/val.bin"]) // BLOCK)
    with ObjectServer(FILES) as http:
        providers = []
        for _ in range(2):
            p = nanogpt(http, tmp_path / "nano", cache_bytes=NEED)
            p.set_meta(p.complete_meta())
            providers.append(p)
        cache = tmp_path / "nano" / "input-cache"
        copies = sorted(cache.glob("file-*"))
        assert sorted(c.name.rsplit("-", 1)[-1] for c in copies) == ["train.bin", "val.bin"]
        store = RemoteStore(RemoteSettings({}, cache, cache_bytes=NEED, block_bytes=BLOCK))
        with store.stat(http.url("other.jsonl")).open() as f:
            assert f.read() == FILES["other.jsonl"]
        assert sorted(cache.glob("file-*")) == copies  # in use: kept over the limit
        for p in providers:
            batch = p.sample_batch("val", torch.Generator().manual_seed(0))
            assert int(batch["x"][0, 0]) in set(TOKENS[20_000:].tolist())
        assert (gets(http, "nano/train.bin"), gets(http, "nano/val.bin")) == blocks


def test_a_pinned_copy_survives_eviction_by_another_process(tmp_path: Path) -> None:
    """The pin is a lock another process sees: a second process that fills the cache with
    blocks deletes other entries, never the copy this process holds."""
    with ObjectServer(FILES) as http:
        cache = tmp_path / "cache"
        store = RemoteStore(RemoteSettings({}, cache, cache_bytes=NEED, block_bytes=BLOCK))
        copy = store.local_copy(store.stat(http.url("nano/train.bin")))
        code = textwrap.dedent(
            f"""
            from queue_providers.remote import RemoteSettings, RemoteStore
            settings = RemoteSettings({{}}, {str(cache)!r}, cache_bytes={NEED}, block_bytes={BLOCK})
            store = RemoteStore(settings)
            for name in ("other.jsonl", "nano/val.bin"):
                with store.stat({http.url("")!r} + name).open() as f:
                    f.read()
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
            env=subprocess_env(),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    assert copy.read_bytes() == FILES["nano/train.bin"]
    assert sum(p.stat().st_size for p in cache.iterdir()) <= NEED + BLOCK


def test_copies_read_once_are_held_only_while_read(tmp_path: Path) -> None:
    """local_files (the tokenized providers' reads) holds its copies during the `with` only:
    inside, eviction keeps them; after, they may go like any entry."""
    from queue_providers.remote import BlockCache, local_files

    with ObjectServer(FILES) as http:
        cache = tmp_path / "cache"
        store = RemoteStore(RemoteSettings({}, cache, cache_bytes=NEED, block_bytes=BLOCK))
        objects = [store.stat(http.url(f"nano/{n}.bin")) for n in ("train", "val")]
        squeeze = BlockCache(cache, max_bytes=1)
        with local_files(objects) as paths:
            squeeze.evict()
            assert [p.read_bytes() for p in paths] == [
                FILES["nano/train.bin"],
                FILES["nano/val.bin"],
            ]
        squeeze.evict()
        assert not any(p.exists() for p in paths)


def test_a_process_killed_as_its_block_lands_leaves_the_cache_within_its_bytes(
    tmp_path: Path,
) -> None:
    """A worker stopped mid-fetch can die between putting a block in place and evicting for
    it: room is made before the block lands, so the cache stays within cache_bytes."""
    from queue_providers.remote.cache import BlockCache

    cache_dir = tmp_path / "input-cache"
    cache = BlockCache(cache_dir, 3 * BLOCK)
    for i in range(3):
        cache.put(f"blk-{i}", bytes([i]) * BLOCK)
    assert cache.total_bytes() == 3 * BLOCK
    # The child dies (SIGKILL, by its own hand) at its first eviction after the rename.
    script = textwrap.dedent(
        f"""
        import os, signal
        from queue_providers.remote.cache import BlockCache

        class Dies(BlockCache):
            def evict(self, keep=None, room=0):
                if keep is not None:
                    os.kill(os.getpid(), signal.SIGKILL)
                super().evict(keep, room)

        Dies({str(cache_dir)!r}, {3 * BLOCK}).put("blk-new", b"n" * {BLOCK})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), timeout=60)
    assert proc.returncode == -9
    assert cache.get("blk-new", BLOCK) == b"n" * BLOCK  # it landed
    assert cache.total_bytes() <= 3 * BLOCK
    assert cache.get("blk-0", BLOCK) is None  # the least recently used made room
