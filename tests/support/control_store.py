"""The job's control plane store for tests: `queue-server control-store` as a real process on a
free loopback port, as a job would run it (or torchrun's TCPStore would be)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from queue_server.testing import SERVER_COMMAND, wait_until


class ControlStore:
    def __init__(self, tmp: Path, env: dict[str, str], listen: str = "127.0.0.1:0") -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        ready = tmp / f"control-store-{listen.replace(':', '_')}.json"
        ready.unlink(missing_ok=True)
        self.log_path = tmp / "control-store.log"
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [*SERVER_COMMAND, "control-store", "--listen", listen,
                 "--ready-file", str(ready)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

        def bound() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"control store exited: {self.log_path.read_text()}")
            return ready.exists()

        wait_until(bound, 60.0, "the control store to listen")
        self.address = json.loads(ready.read_text())["address"]
        self.url = f"tcpstore://{self.address}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
