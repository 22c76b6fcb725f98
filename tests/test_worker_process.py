"""A worker start cancelled midway (a server stopping while it starts workers) leaves the
forkserver serving: it once read EOF, printed a traceback over the server's last line and
exited, which is how a stopping server's exit message could end in `EOFError`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
