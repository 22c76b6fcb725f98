"""Asking a Ray cluster's head (its GCS) who it is, before and while the server is joined.

ray.init retries for as long as it is let on an address where the head refuses it, and only
Ray's log says why: a head with token authentication on answers every call without the right
token with UNAUTHENTICATED ("InvalidAuthToken"). One GetClusterId call of our own, with the
token Ray would send, tells in a second whether something listens, whether it takes our token,
and which cluster it is: a head started again at the same address is a new cluster, whose
id differs, and a driver of the old one must join it afresh.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc

# The GCS's method that every joining driver calls first (Ray's NodeInfoGcsService); its
# reply holds the cluster's id. An empty request is a valid one.
_CLUSTER_ID_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


class HeadRefused(Exception):
    """The head answered, but refused this process's token (token authentication)."""


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT" (or "ray://HOST:PORT"); None for "auto" and friends."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if sep and port.isdigit():
        return host.strip("[]"), int(port)
    return None


def listening(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the address (True for "auto")."""
    where = host_port(address)
    if where is None:
        return True
    try:
        socket.create_connection(where, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def auth_mode() -> str:
    """This process's RAY_AUTH_MODE as Ray reads it ("" when unset)."""
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower()


def token_source() -> tuple[str, str]:
    """(token, where it came from) as Ray looks for it: RAY_AUTH_TOKEN, then the file
    RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token; ("", "") when there is none or
    RAY_AUTH_MODE is "disabled" (Ray then sends none)."""
    if auth_mode() == "disabled":
        return "", ""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token, "RAY_AUTH_TOKEN"
    named = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    path = Path(named).expanduser() if named else Path.home() / ".ray" / "auth_token"
    try:
        token = path.read_text().strip()
    except OSError:
        return "", ""
    return (token, str(path)) if token else ("", "")


def cluster_id(address: str, timeout_s: float = 3.0) -> bytes | None:
    """The reply of the head's GetClusterId (it holds the cluster's id), None where no Ray
    head answers in time. Raises HeadRefused where the head refuses our token."""
    where = host_port(address)
    if where is None:
        return None
    token, _ = token_source()
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(f"{where[0]}:{where[1]}") as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(_CLUSTER_ID_METHOD)
        try:
            return bytes(call(b"", timeout=timeout_s, metadata=metadata))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise HeadRefused(exc.details() or "UNAUTHENTICATED") from None
            return None


def refused_message(address: str, details: str) -> str:
    """What to do when the head refuses us: which token we sent, and where it must come from."""
    token, source = token_source()
    if token:
        sent = f"the token from {source} is not the cluster's"
    elif auth_mode() == "disabled":
        sent = "this server runs with RAY_AUTH_MODE=disabled, so it sent no token"
    else:
        sent = "this server found no token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)"
    return (
        f"ray_address = {address!r}: the Ray cluster there has token authentication on and "
        f"refused this server ({details}): {sent}. Start the server with RAY_AUTH_MODE=token "
        "and the cluster's token in RAY_AUTH_TOKEN, or in a file named by RAY_AUTH_TOKEN_PATH "
        "(`ray get-auth-token` on the head prints it)"
    )
