"""The key-value engine under the control plane: torch.distributed's TCPStore, the store
torchrun already runs for the job (or one `queue-server control-store` hosts).

Only three calls are needed, and each is a single TCPStore request, so the log built on them
(steering/log.py) is as consistent as the store itself: put-if-absent (compare_set against
"no value"), get, and a blocking wait for a key. No consensus of our own: the store's one
master orders the writes. Every call blocks, so the plane makes them in its own thread.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Protocol

from queue_client.errors import ConfigError

SCHEME = "tcpstore://"


class ControlStore(Protocol):
    """A store's calls, as the log uses them (blocking)."""

    def put_if_absent(self, key: str, value: bytes) -> bytes:
        """Set key to value unless it has one; returns the value it holds afterwards."""
        ...

    def get(self, key: str) -> bytes | None:
        """The key's value, or None while it has none."""
        ...

    def wait(self, key: str, timeout_s: float) -> bool:
        """Block until key has a value (True) or timeout_s passed (False)."""
        ...

    def close(self) -> None: ...


def parse_address(spec: str, setting: str) -> tuple[str, int]:
    """HOST:PORT out of "tcpstore://HOST:PORT" (ConfigError naming the setting otherwise)."""
    rest = spec[len(SCHEME) :] if spec.startswith(SCHEME) else ""
    host, sep, port = rest.rpartition(":")
    if not rest or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{setting} = {spec!r} is invalid: expected {SCHEME}HOST:PORT, the address of a "
            'torch.distributed TCPStore (torchrun\'s MASTER_ADDR:MASTER_PORT), or "" for none'
        )
    return host.strip("[]"), int(port)


class TorchStore:
    """A client of a TCPStore at host:port (torch imported here only: a server without a
    control plane never loads it)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        _quiet_torch_logs()
        from torch.distributed import TCPStore

        self.address = f"{host}:{port}"
        self._store: Any = TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def put_if_absent(self, key: str, value: bytes) -> bytes:
        return bytes(self._store.compare_set(key, "", value))

    def get(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def wait(self, key: str, timeout_s: float) -> bool:
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # DistStoreError: a timeout, or the store went away
            if "timeout" in str(exc).lower():
                return False
            raise
        return True

    def close(self) -> None:
        self._store = None


def host_store(host: str, port: int) -> Any:
    """A TCPStore master on host:port (`queue-server control-store`), for jobs whose launcher
    runs none the servers can reach; it serves until its process ends."""
    _quiet_torch_logs()
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False)


def _quiet_torch_logs() -> None:
    """c10d logs a warning each time a wait for a key times out, which the watcher's waits
    do by design: keep torch's C++ log to errors in this process (read as torch loads; the
    server imports torch for the store alone). An explicit TORCH_CPP_LOG_LEVEL wins."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
