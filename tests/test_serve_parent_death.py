"""A server started by `serve()` ends with the process that started it: a caller killed with
SIGKILL leaves no server on its port, no workers, no lock on the data root and no private
socket folder behind. And the pipe that tells the server so is held by its caller alone: a
process forked from the caller does not keep it open."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from conftest import (
    assert_root_serves_again,
    char_config,
    kill_leftovers,
    process_gone,
    process_tree,
    run_client_script,
    subprocess_env,
    wait_until,
)
from queue_client import QueueClient
from queue_server import serve


@pytest.mark.cold_forkserver  # the server, its forkserver and workers end with the caller
def test_a_server_whose_caller_is_killed_stops_and_frees_the_data_root(
    corpus: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    said = tmp_path / "address.txt"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import os, time
                from queue_server import serve

                with serve({char_config(corpus)!r}, data_root={str(root)!r}, unix_socket=True) as address:
                    with open({str(said)!r} + ".tmp", "w") as f:
                        f.write(address)
                    os.replace({str(said)!r} + ".tmp", {str(said)!r})
                    time.sleep(600)  # killed long before
                """
            ),
        ],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server_side: set[int] = set()
    try:
        wait_until(lambda: said.exists() or caller.poll() is not None, 120, "serve() to return")
        assert caller.poll() is None, "the calling process ended while the server started"
        address = said.read_text()
        socket_dir = Path(address.removeprefix("unix:")).parent
        assert socket_dir.is_dir()
        # The server, its forkserver and its workers: all descend from the caller for now.
        server_side = process_tree(caller.pid) - {caller.pid}
        assert len(server_side) >= 2, server_side
        caller.kill()
        caller.wait(timeout=30)
        wait_until(
            lambda: all(process_gone(pid) for pid in server_side),
            120,
            f"the server processes {sorted(server_side)} to end with their caller",
        )
        assert not socket_dir.exists()
    finally:
        if caller.poll() is None:
            caller.kill()
        kill_leftovers(server_side)
    assert_root_serves_again(tmp_path / "again", root, char_config(corpus))


def test_a_process_forked_from_the_caller_does_not_keep_the_pipe_open() -> None:
    proc = run_client_script(
        """
        import os, select
        from queue_server.host.parent_watch import ParentPipe

        pipe = ParentPipe()
        watched = os.dup(pipe.read_fd)
        child = os.fork()
        if child == 0:  # a forked process that outlives the write end's owner closing it
            select.select([], [], [], 60)
            os._exit(0)
        pipe.close()
        readable, _, _ = select.select([watched], [], [], 30)
        print("eof" if readable and os.read(watched, 1) == b"" else "still open")
        os.kill(child, 9)
        os.waitpid(child, 0)
        """
    )
    assert proc.stdout.strip() == "eof"


def test_the_server_outlives_the_thread_that_started_it(corpus: Path, tmp_path: Path) -> None:
    """The process's death stops the server, not the end of the thread that called serve()
    (serve_async enters in a worker thread): a parent-death signal would get this wrong."""
    manager = serve(char_config(corpus), data_root=tmp_path / "root")
    entered: list[str] = []
    starter = threading.Thread(target=lambda: entered.append(manager.__enter__()))
    starter.start()
    starter.join(timeout=180)
    assert entered, "serve() did not return within 180 s"
    try:
        with QueueClient(entered[0], "chars", rank=0, world_size=1) as client:
            assert tuple(client.get_batch("train")[0].shape) == (4, 16)
    finally:
        manager.__exit__(None, None, None)
