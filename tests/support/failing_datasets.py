"""Datasets that must fail at start, each with its message: one --keep-serving server holds
them all, and the test reads every dataset's last error once all have failed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from queue_server.testing import ServerProcess, wait_until


def errors_of_failed(
    workdir: Path,
    config_text: str,
    names: Iterable[str],
    env: Mapping[str, str],
    *,
    timeout_s: float = 120.0,
) -> dict[str, str]:
    """Each named dataset's last error, once every one of them has failed."""
    wanted = list(names)
    server = ServerProcess(
        workdir / "server",
        data_root=workdir / "data",
        config_text=config_text,
        args=("--metrics-listen", "127.0.0.1:0", "--keep-serving"),
        env=env,
    )
    try:
        server.wait_bound(60)
        return wait_until(
            lambda: (
                all(server.stats(n)["state"] == "failed" for n in wanted)
                and {n: server.stats(n)["last_error"] for n in wanted}
            ),
            timeout_s,
            f"datasets {wanted} to fail",
        )
    finally:
        server.stop()
