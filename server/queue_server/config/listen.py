"""Where a server listens: HOST:PORT, [::1]:PORT or unix:PATH, parsed once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from queue_client.errors import ConfigError
from queue_server.config.checks import check


@dataclass(frozen=True)
class ListenAddress:
    """Where the server listens: host and port, or a unix socket path."""

    host: str | None
    port: int | None
    unix_path: str | None

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.unix_path:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback  # type: ignore[union-attr]
        except ValueError:
            return False


def parse_listen(listen: str) -> ListenAddress:
    """ "HOST:PORT", "[::1]:PORT" or "unix:PATH"; port 0 picks a free port."""
    if not isinstance(listen, str) or not listen:
        raise ConfigError(f"server.listen = {listen!r} is invalid: expected HOST:PORT or unix:PATH")
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        check(bool(path), "server.listen", listen, "unix:PATH with a path")
        return ListenAddress(None, None, path)
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError(
            f"server.listen = {listen!r} is invalid: expected HOST:PORT (port 0-65535) or unix:PATH"
        )
    return ListenAddress(host, int(port), None)
