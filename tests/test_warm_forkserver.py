"""The tests' servers fork their workers' forkserver warm (warm_forkserver.py): it must be a
forkserver as multiprocessing would start it, with the server's environment and working
directory, that ends with its server, and a cold one wherever the zygote cannot stand in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import warm_forkserver

from conftest import (
    ServerFactory,
    char_config,
    process_gone,
    process_tree,
    subprocess_env,
    wait_until,
)
from queue_client import QueueClient


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _serving_worker(start_server: ServerFactory, corpus: Path, **env: str) -> tuple[int, int]:
    """(server pid, a train worker's pid) of a server that served a batch."""
    server = start_server(char_config(corpus), env={"BQ_WARM_PROBE": "this server's", **env})
    with QueueClient(server.address, "chars", rank=0, world_size=1) as client:
        client.get_batch("train")
    pids = wait_until(
        lambda: [int(w["pid"]) for w in server.split_stats("chars")["workers"] if int(w["pid"])],
        60,
        "a train worker's pid",
    )
    return server.pid, pids[0]


def test_a_servers_forkserver_is_forked_by_the_zygote_and_ends_with_it(
    start_server: ServerFactory, corpus: Path
) -> None:
    if warm_forkserver.PID_ENV not in os.environ:
        pytest.skip("no #! line can name this interpreter, so no test server forks warm")
    zygote = int(os.environ[warm_forkserver.PID_ENV])
    server_pid, worker = _serving_worker(start_server, corpus)
    forkserver = _ppid(worker)
    assert _ppid(forkserver) == zygote
    assert forkserver not in process_tree(server_pid)
    # A fresh forkserver's working directory is the server's (its environment: below).
    assert os.readlink(f"/proc/{forkserver}/cwd") == os.readlink(f"/proc/{server_pid}/cwd")
    shims = [
        pid
        for pid in process_tree(server_pid)
        if b"forkserver-shim" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(shims) == 1, shims
    start_server.servers[-1].stop()
    wait_until(
        lambda: all(process_gone(pid) for pid in (forkserver, worker, shims[0])),
        60,
        f"the forkserver {forkserver}, its worker {worker} and the shim {shims[0]} to end",
    )


def test_a_worker_has_its_servers_environment_and_import_path(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    """Not the zygote's, which it was forked from: os.environ and sys.path are the server's, as
    a forkserver that the server started would have them."""
    config = """
[datasets.env]
provider = "bq_test_providers:EnvironProvider"
batch_size = 2
batches_per_file = 2
"""
    server = start_server(
        config,
        wait_serving=False,
        env={
            "BQ_WARM_PROBE": "this server's",
            "PYTHONPATH": f"{tmp_path}:{subprocess_env()['PYTHONPATH']}",
        },
    )
    wait_until(lambda: server.proc.poll() is not None, 60, "the server to fail its dataset")
    seen = server.log()
    assert 'worker sees BQ_WARM_PROBE="this server\'s"' in seen, seen
    assert f"'{tmp_path}'" in seen.split("sys.path", 1)[1], seen


@pytest.mark.cold_forkserver
def test_a_cold_test_gets_a_forkserver_of_the_servers_own(
    start_server: ServerFactory, corpus: Path
) -> None:
    server_pid, worker = _serving_worker(start_server, corpus)
    assert _ppid(_ppid(worker)) == server_pid


def test_a_zygote_that_does_not_answer_leaves_the_real_interpreter(
    start_server: ServerFactory, corpus: Path, tmp_path: Path
) -> None:
    server_pid, worker = _serving_worker(
        start_server, corpus, **{warm_forkserver.ADDRESS_ENV: str(tmp_path / "no-zygote")}
    )
    forkserver = _ppid(worker)
    assert _ppid(forkserver) == server_pid
    assert b"forkserver-shim" not in Path(f"/proc/{forkserver}/cmdline").read_bytes()
