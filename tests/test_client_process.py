"""The tests' forked trainer processes behave as `python -c` ones do: stdio, exit status,
signals, environment and atexit handlers."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from client_process import ClientProcess


def test_output_exit_status_and_environment() -> None:
    code = (
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('out', os.environ['BQ_PROBE'], sys.argv[0], 'torch' in sys.modules)\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    proc = ClientProcess(code=code, env={"BQ_PROBE": "yes"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out.splitlines() == ["out yes -c True", "atexit ran"]
    assert err == "err\n"
    assert proc.pid != os.getpid()


def test_the_environment_is_the_callers_at_the_start_not_the_forkservers(monkeypatch) -> None:
    ClientProcess(code="pass").communicate(timeout=60)  # the forkserver runs already
    monkeypatch.setenv("BQ_SET_LATER", "1")
    monkeypatch.delenv("BQ_GONE", raising=False)
    code = "import os\nprint(os.environ.get('BQ_SET_LATER'), os.environ.get('BQ_GONE'))"
    out, _ = ClientProcess(code=code).communicate(timeout=60)
    assert out == "1 None\n"


def test_an_exception_exits_1_with_its_traceback_and_stdin_is_read() -> None:
    proc = ClientProcess(
        code="import sys\nprint(sys.stdin.readline().strip())\nraise KeyError('k')"
    )
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (1, "hello\n")
    assert "KeyError: 'k'" in err


def test_a_killed_process_reports_the_signal_and_a_wait_times_out() -> None:
    proc = ClientProcess(code="import sys\nprint('READY', flush=True)\nsys.stdin.read()")
    assert proc.stdout.readline() == "READY\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL


def test_a_script_runs_as_main_with_its_arguments(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print(sys.argv[1:])\n")
    proc = ClientProcess(script, ["a", "b"])
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (0, "['a', 'b']\n")
