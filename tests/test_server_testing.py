"""queue_server.testing, the server processes the suite and the benchmarks start: a failed
start names the server's log, a graceful stop ends the process, a hung one is killed and
reported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import (
    assert_root_serves_again,
    char_config,
    kill_leftovers,
    process_gone,
    process_tree,
    subprocess_env,
)
from queue_server.testing import ServerExited, ServerProcess, wait_until

# Stands in for a server that binds but ignores SIGTERM: the one shape stop() must not wait out.
_DEAF_SERVER = textwrap.dedent(
    """
    import json, os, signal, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready = sys.argv[sys.argv.index("--ready-file") + 1]
    with open(ready + ".tmp", "w") as f:  # whole or not at all, as queue-server writes it
        json.dump({"address": "127.0.0.1:1"}, f)
    os.replace(ready + ".tmp", ready)
    signal.pause()
    """
)


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    assert wait_until(lambda: 7, 1.0, "seven") == 7
    with pytest.raises(TimeoutError, match=r"after 0\.05s waiting for the moon"):
        wait_until(lambda: None, 0.05, "the moon")


def test_a_server_that_exits_while_starting_names_its_log(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text="[server]\nno_such_key = 1\n",
        env=subprocess_env(),
    )
    with pytest.raises(ServerExited, match=r"(?s)exited with [1-9].*no_such_key"):
        server.wait_serving(60)


def test_stop_ends_a_serving_server_gracefully(tmp_path: Path, corpus: Path) -> None:
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        config_text=char_config(corpus),
        env=subprocess_env(),
    )
    server.wait_serving(60)
    assert server.split_stats("chars")["split"] == "train"
    server.stop()
    assert server.proc.returncode == 0, server.log_tail()


def test_stop_kills_a_server_that_ignores_sigterm_and_says_so(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "server",
        data_root=tmp_path / "data",
        command=(sys.executable, "-c", _DEAF_SERVER),
        env=subprocess_env(),
    )
    server.wait_bound(30)
    assert server.address == "127.0.0.1:1"
    with pytest.raises(TimeoutError, match=r"did not stop within 0\.5s of SIGTERM"):
        server.stop(timeout_s=0.5)
    assert server.proc.returncode is not None and server.proc.returncode < 0


@pytest.mark.cold_forkserver  # the server's forkserver and workers must end with it
def test_a_server_whose_test_process_is_killed_stops_and_frees_the_data_root(
    tmp_path: Path, corpus: Path
) -> None:
    """A test run that is itself killed (a timeout, a Ctrl-C twice, SIGKILL) leaves no server
    behind to hold a port, a data-root lock and CPU: each one watches a pipe from the process
    that started it, and stops gracefully once that process is gone."""
    root, said = tmp_path / "data", tmp_path / "serving"
    harness = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import os, time
                from pathlib import Path
                from queue_server.testing import ServerProcess

                server = ServerProcess(
                    Path({str(tmp_path / "server")!r}),
                    data_root=Path({str(root)!r}),
                    config_text={char_config(corpus)!r},
                )
                server.wait_serving(120)
                Path({str(said)!r} + ".tmp").write_text(str(server.pid))
                os.replace({str(said)!r} + ".tmp", {str(said)!r})
                time.sleep(600)  # killed long before
                """
            ),
        ],
        env=subprocess_env(),
    )
    server_side: set[int] = set()
    try:
        wait_until(lambda: said.exists() or harness.poll() is not None, 150, "a serving server")
        assert harness.poll() is None, "the harness ended while its server started"
        server_pid = int(said.read_text())
        server_side = process_tree(server_pid)
        assert len(server_side) >= 2, server_side  # the server and its forkserver at least
        harness.kill()
        harness.wait(timeout=30)
        wait_until(
            lambda: all(process_gone(pid) for pid in server_side),
            120,
            f"the server processes {sorted(server_side)} to end with their test process",
        )
        log = (tmp_path / "server" / "server.log").read_text(errors="replace")
        assert "shutting down (SIGTERM)" in log, log[-2000:]  # the graceful stop, not a kill
    finally:
        if harness.poll() is None:
            harness.kill()
        kill_leftovers(server_side)
    assert_root_serves_again(tmp_path / "again", root, char_config(corpus))


def test_a_parent_pipe_that_is_not_an_open_pipe_is_refused_by_name(tmp_path: Path) -> None:
    """A wrong descriptor would read as a parent already gone and stop the server at once
    with nothing said; it is refused before anything starts, naming the flag and the fd."""
    with open(tmp_path / "plain.txt", "w") as plain:
        for fd, why in ((987, "not an open descriptor"), (plain.fileno(), "not a pipe")):
            done = subprocess.run(
                [sys.executable, "-m", "queue_server", "--parent-pipe", str(fd),
                 "--data-root", str(tmp_path / "data"), "--listen", "127.0.0.1:0",
                 "--metrics-listen", ""],
                capture_output=True, text=True, timeout=120, env=subprocess_env(),
                pass_fds=(plain.fileno(),),
            )  # fmt: skip
            assert done.returncode == 2, done.stderr
            assert f"--parent-pipe {fd}: {why}" in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()  # refused before the data root was touched
