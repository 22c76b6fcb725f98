"""A worker start cancelled midway (a server stopping while it starts workers) leaves the
forkserver serving: it once read EOF, printed a traceback over the server's last line and
exited, which is how a stopping server's exit message could end in `EOFError`. And a
forkserver whose server is gone while it still imports torch exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import kill_leftovers, process_gone, process_tree, subprocess_env, wait_until

SCRIPT = textwrap.dedent(
    """
    import asyncio
    from pathlib import Path

    from queue_server.production.worker_process import WorkerDied, WorkerError, WorkerProcess


    async def main() -> None:
        # Cancelled at spread-out points of the start, some inside the forkserver hand-off.
        for i in range(30):
            worker = WorkerProcess(f"worker {i}", {}, Path.cwd())
            starting = asyncio.ensure_future(worker.start())
            await asyncio.sleep(0.0005 * (i % 10))
            starting.cancel()
            try:
                await starting
            except (asyncio.CancelledError, WorkerError, WorkerDied):
                pass
            await worker.stop()
        last = WorkerProcess("last", {}, Path.cwd())
        try:
            await last.start()
        except WorkerError as exc:  # an empty init is refused: the worker ran and answered
            print("answered:", exc)
        await last.stop()


    if __name__ == "__main__":
        asyncio.run(main())
    """
)


def test_a_cancelled_worker_start_leaves_the_forkserver_serving(tmp_path: Path) -> None:
    script = tmp_path / "cancel_starts.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("answered:"), (done.stdout, done.stderr)


STARTER = textwrap.dedent(
    """
    import time
    from queue_server.production.forkserver_start import start_forkserver

    start_forkserver()
    print("started", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.cold_forkserver  # the forkserver's own torch import
def test_a_forkserver_whose_server_is_gone_mid_import_exits_at_once(tmp_path: Path) -> None:
    """The server starts the forkserver before anything else; one that exits early (a config
    error, a kill) used to leave it importing torch to the end, seconds of CPU on a busy
    machine. Here its torch import never ends (a stand-in torch that blocks): the forkserver
    must still exit once its server is SIGKILLed, not wait for the import."""
    blocking = tmp_path / "blocking" / "torch"
    blocking.mkdir(parents=True)
    importing = tmp_path / "importing"
    (blocking / "__init__.py").write_text(
        f"import pathlib, time\npathlib.Path({str(importing)!r}).touch()\ntime.sleep(3600)\n"
    )
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocking.parent), env["PYTHONPATH"]])
    server = subprocess.Popen(
        [sys.executable, "-c", STARTER], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    started: set[int] = {server.pid}
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "started"
        wait_until(importing.exists, 120, "the forkserver to begin importing torch")
        below = process_tree(server.pid) - {server.pid}
        forkservers = [p for p in below if b"forkserver" in _cmdline(p)]
        assert len(forkservers) == 1, forkservers
        started.update(forkservers)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        wait_until(
            lambda: process_gone(forkservers[0]),
            30,
            f"the forkserver (pid {forkservers[0]}) to exit once its server was gone",
        )
    finally:
        kill_leftovers(started)
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no thread on one core")
def test_the_preload_loads_openblas_with_one_thread_unless_told() -> None:
    """A worker is one thread of work: numpy's OpenBLAS, loaded by the forkserver's preload,
    starts no thread of its own (it started one per core, for a composer's matrix-vector
    product); an OPENBLAS_NUM_THREADS the environment sets is kept, and starts its threads."""

    def preload(blas_threads: str | None) -> tuple[str, int]:
        code = (
            "import os, queue_server.production.forkserver_preload\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n"
        )
        environ = subprocess_env()
        environ.pop("OPENBLAS_NUM_THREADS", None)
        if blas_threads is not None:
            environ["OPENBLAS_NUM_THREADS"] = blas_threads
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120
        )
        assert done.returncode == 0, done.stderr
        setting, threads = done.stdout.split()
        return setting, int(threads)

    (default, one), (kept, two) = preload(None), preload("2")
    assert (default, kept) == ("1", "2")
    assert two == one + 1  # the one extra thread OpenBLAS starts when told 2
