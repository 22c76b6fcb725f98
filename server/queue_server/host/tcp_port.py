"""Telling why the gRPC address cannot be listened on, in one line, before gRPC tries.

gRPC's bind failure is a RuntimeError that names no cause, after its C core has logged its
own line to stderr, so the server asks the kernel first: a test bind of each address the host
resolves to, as gRPC binds them (SO_REUSEADDR, no SO_REUSEPORT). Where none binds, the error
names the address, the setting and the kernel's reason (most often a second server on the
host at the same --listen). The test socket is closed before gRPC binds: a process that
takes the port in between still fails in gRPC, with the same message and no cause.
"""

from __future__ import annotations

import socket

SETTING = "server.listen, --listen"


def listen_error(shown: str, why: str) -> OSError:
    """The one-line error for an address this server cannot listen on."""
    return OSError(
        f"cannot listen for gRPC on {shown} ({SETTING}): {why}; another process, such as a "
        "second queue-server on this host, may hold it: give each server its own --listen"
    )


def check_free(host: str, port: int, shown: str) -> None:
    """Raise listen_error when no address `host` resolves to can be bound at `port`; port 0
    (the kernel picks) and a host that does not resolve are left to gRPC."""
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError):
        return
    why = ""
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                why = why or (exc.strerror or str(exc)).lower()
                continue
        return  # gRPC binds when any one of them does
    if why:
        raise listen_error(shown, why)
