"""queue_server.testing, the server processes the suite and the benchmarks start: a failed
start names the server's log, a graceful stop ends the process, a hung one is killed and
reported."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from conftest import char_config, subprocess_env
from queue_server.testing import ServerExited, ServerProcess, wait_until

# Stands in for a server that binds but ignores SIGTERM: the one shape stop() must not wait out.
_DEAF_SERVER = textwrap.dedent(
    """
    import json, signal, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready = sys.argv[sys.argv.index("--ready-file") + 1]
    with open(ready, "w") as f:
        json.dump({"address": "127.0.0.1:1"}, f)
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
