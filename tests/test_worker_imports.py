"""Workers import torch only where their provider needs it: a char_lm dataset's workers and
their forkserver never load it (most of a first start, and of the loader's memory), while a
provider that uses torch gets it preloaded once in the forkserver for every worker to share."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import char_config, process_tree
from queue_client import QueueClient
from queue_server.production.worker_imports import (
    config_needs_torch,
    datasets_need_torch,
    tables_need_torch,
)

TINY = """
[datasets.tiny]
provider = "bq_test_providers:TinyProvider"
batch_size = 2
batches_per_file = 2
"""


def _maps_torch(pid: int) -> bool:
    """Whether process `pid` has torch's native library mapped (torch imported)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _forkserver(server_pid: int, workers: list[int]) -> int:
    """The workers' forkserver: their parent (they run its command line, forked from it),
    the server's child."""
    (forkserver,) = {_parent(pid) for pid in workers}
    assert _parent(forkserver) == server_pid
    assert b"multiprocessing.forkserver" in Path(f"/proc/{forkserver}/cmdline").read_bytes()
    return forkserver


def _worker_pids(server, dataset: str) -> list[int]:
    return [int(p) for p in server.split_stats(dataset, "train")["worker_pids"]]


@pytest.mark.cold_forkserver  # the server's own forkserver, not the tests' warm one
def test_a_char_lm_server_and_its_workers_never_load_torch(start_server, corpus: Path) -> None:
    server = start_server(char_config(corpus, extra="workers = 2"))
    server.wait_ready_files("chars", 2)
    with QueueClient(server.address, "chars") as client:
        assert client.get_batch("train")[0].shape == (4, 16)
    workers = _worker_pids(server, "chars")
    assert len(workers) == 2
    tree = process_tree(server.pid)
    assert {_forkserver(server.pid, workers), *workers} <= tree
    loaded = sorted(pid for pid in tree if _maps_torch(pid))
    assert loaded == [], f"processes under the server with torch loaded: {loaded}"


@pytest.mark.cold_forkserver
def test_a_mixture_of_token_shards_and_its_workers_never_load_torch(
    start_server, tmp_path: Path
) -> None:
    """A weighted mixture of pre-tokenized corpora copies its sources' stored rows: its
    forkserver preloads no torch and no worker imports it."""
    import numpy as np

    config = "[datasets.mix]\nbatch_size = 2\nbatches_per_file = 3\nworkers = 2\n"
    for i, weight in enumerate((0.7, 0.3)):
        path = tmp_path / f"c{i}.bin"
        (np.arange(2_000, dtype=np.uint16) * (i + 3) % 300).tofile(path)
        config += (
            f'[datasets.mix.sources.c{i}]\nprovider = "token_shards"\nweight = {weight}\n'
            f"[datasets.mix.sources.c{i}.args]\n"
            f'inputs = ["{path.as_posix()}"]\nblock_size = 8\nvocab_size = 300\n'
        )
    server = start_server(config)
    server.wait_ready_files("mix", 2)
    with QueueClient(server.address, "mix") as client:
        assert set(client.get_batch("train")) == {"x", "y", "source"}
    workers = _worker_pids(server, "mix")
    tree = process_tree(server.pid)
    assert {_forkserver(server.pid, workers), *workers} <= tree
    loaded = sorted(pid for pid in tree if _maps_torch(pid))
    assert loaded == [], f"processes under the server with torch loaded: {loaded}"


@pytest.mark.cold_forkserver
def test_a_torch_provider_gets_torch_preloaded_in_the_forkserver(
    start_server, corpus: Path
) -> None:
    """One dataset whose provider uses torch (a class of the operator's own) beside char_lm:
    the forkserver imports torch before any worker forks, so every worker shares it."""
    server = start_server(char_config(corpus) + TINY)
    server.wait_ready_files("chars", 1)
    server.wait_ready_files("tiny", 1)
    workers = _worker_pids(server, "tiny") + _worker_pids(server, "chars")
    assert _maps_torch(_forkserver(server.pid, workers))
    for pid in workers:
        assert _maps_torch(pid), pid
    assert not _maps_torch(server.pid)  # the server itself never imports torch


@pytest.mark.parametrize(
    ("datasets", "needs"),
    [
        ([("char_lm", None)], False),
        ([("char_lm", {}), ("char_lm", {"block_size": 8})], False),
        ([("char_lm", None), ("nanogpt_bin", {"data_dir": "d"})], False),
        ([("token_shards", {"inputs": ["a.bin"]})], False),  # window order, the default
        ([("token_shards", {"order": "windows"})], False),
        ([("token_shards", {"order": "documents"})], True),  # encoded through torch
        ([("char_lm", None), ("text_lm", None)], True),
        ([("bq_test_providers:TinyProvider", None)], True),  # the operator's own class
        ([("char_lm", "not a table")], True),
        ([], True),
        ([(None, None)], True),  # a dataset without a provider: the config's error
    ],
)
def test_torch_is_preloaded_unless_every_dataset_is_torch_free(
    datasets: list[tuple[object, object]], needs: bool
) -> None:
    assert datasets_need_torch(datasets) is needs
    tables = {
        "datasets": {f"d{i}": {"provider": p, "args": a} for i, (p, a) in enumerate(datasets)}
    }
    assert tables_need_torch(tables) is needs


def _source(provider: object, args: object = None) -> dict[str, object]:
    return {"name": "s", "weight": 1.0, "provider": provider, "args": args}


@pytest.mark.parametrize(
    ("sources", "needs"),
    [
        ([_source("nanogpt_bin"), _source("token_shards", {"order": "windows"})], False),
        ([_source("char_lm")], False),
        ([_source("nanogpt_bin"), _source("text_lm")], True),  # text_lm encodes with torch
        ([_source("token_shards", {"order": "documents"})], True),
        ([], True),
        (["not a table"], True),
        ("not a list", True),
    ],
)
def test_a_mixture_of_torch_free_sources_is_torch_free(sources: object, needs: bool) -> None:
    """A mixture copies its sources' stored rows (mixture/provider.py): torch-free where
    they all are, read from the parsed config (a `mixture` provider with a list of sources)
    and from the TOML tables (a dataset with a table of `sources` tables)."""
    assert datasets_need_torch([("mixture", {"sources": sources})]) is needs
    if isinstance(sources, list):
        tables = {f"s{i}": s for i, s in enumerate(sources)}
        assert tables_need_torch({"datasets": {"mix": {"sources": tables}}}) is needs
    # A table of sources that also names a provider is the config's error: torch, to be safe.
    assert tables_need_torch({"datasets": {"mix": {"provider": "x", "sources": {}}}}) is True


def test_a_config_file_decides_and_one_that_cannot_be_read_preloads_torch(
    tmp_path: Path, corpus: Path
) -> None:
    assert config_needs_torch(None) is False  # the embedded default: stdlib_char, char_lm
    chars = tmp_path / "chars.toml"
    chars.write_text(char_config(corpus))
    assert config_needs_torch(chars) is False
    mixed = tmp_path / "mixed.toml"
    mixed.write_text(char_config(corpus) + TINY)
    assert config_needs_torch(mixed) is True
    broken = tmp_path / "broken.toml"
    broken.write_text('[datasets.a\nprovider = "char_lm"\n')
    assert config_needs_torch(broken) is True
    assert config_needs_torch(tmp_path / "missing.toml") is True
    assert tables_need_torch({"datasets": "not a table"}) is True


@pytest.mark.cold_forkserver
def test_a_serve_block_of_char_lm_loads_no_torch_either(tmp_path: Path, corpus: Path) -> None:
    """serve()'s child decides from its spec as `queue-server` does from --config."""
    import os

    from queue_server import serve

    with serve(char_config(corpus), data_root=tmp_path / "data") as address:
        with QueueClient(address, "chars") as client:
            client.get_batch("train")
        (child,) = [
            pid
            for pid in process_tree(os.getpid())
            if b"serve_child" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        tree = process_tree(child)
        assert len(tree) >= 3  # the child, its forkserver, a worker
        loaded = sorted(pid for pid in tree if _maps_torch(pid))
        assert loaded == [], f"processes under serve()'s child with torch loaded: {loaded}"


def test_a_faulty_config_argument_gets_the_commands_own_usage() -> None:
    """`queue-server` peeks at --config before anything else to decide on torch; a fault in
    the arguments is still reported by the command itself, with its whole usage."""
    import subprocess
    import sys

    from conftest import subprocess_env

    proc = subprocess.run(
        [sys.executable, "-m", "queue_server", "--config"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--data-root" in proc.stderr and "--config: expected one argument" in proc.stderr


EMBEDDER = """
import asyncio, dataclasses, pathlib, sys

from queue_server.app import create_server
from queue_server.config.server import load_config

config = dataclasses.replace(
    load_config(pathlib.Path(sys.argv[1])), data_root=pathlib.Path(sys.argv[2]),
    listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
)

async def main():
    server, address = await create_server(config)
    print(address, flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # until the test has looked
    await server.stop()

asyncio.run(main())
"""


@pytest.mark.cold_forkserver
@pytest.mark.parametrize("with_torch_provider", [False, True], ids=["char_lm", "and-a-torch-one"])
def test_an_embedder_of_queue_server_gets_the_same_decision(
    tmp_path: Path, corpus: Path, with_torch_provider: bool
) -> None:
    """A program that starts a QueueServer itself (create_server, neither `queue-server` nor
    serve()) gets its forkserver decided from the config in QueueServer.start."""
    import subprocess
    import sys

    from conftest import subprocess_env

    config = tmp_path / "embedded.toml"
    config.write_text(char_config(corpus) + (TINY if with_torch_provider else ""))
    with subprocess.Popen(
        [sys.executable, "-c", EMBEDDER, str(config), str(tmp_path / "data")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env(),
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdin is not None
            address = proc.stdout.readline().strip()
            assert address, "the embedder did not start its server"
            with QueueClient(address, "chars") as client:
                client.get_batch("train")
            (forkserver,) = [  # the embedder's child (its workers run its command line too)
                pid
                for pid in process_tree(proc.pid)
                if _parent(pid) == proc.pid
                and b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]
            assert _maps_torch(forkserver) is with_torch_provider
            assert not _maps_torch(proc.pid)  # the embedder's server imports no torch itself
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
