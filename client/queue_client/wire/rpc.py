"""The client's one door to the server: retries while the server is away, errors by name.

UNAVAILABLE (server restarting, not up yet) is retried with capped exponential backoff until
`reconnect_timeout_s` has passed, then becomes ServerUnavailable naming the address. Every
other failure maps to the batchqueue error the server raised (queue_client.wire.codes).

The first connection is different: a server that never answered is most likely a wrong
address or one not started, so the first call waits for the channel at most
`connect_timeout_s` (CONNECT_TIMEOUT_S) and then fails naming the address and the last
connection error, instead of retrying for `reconnect_timeout_s`.

TLS: with `tls_ca_file` (or $BATCHQUEUE_TLS_CA_FILE), a PEM file of the certificate(s) to
trust, the channel is TLS and checks that the server's certificate names the address's host.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import grpc

from queue_client.errors import InvalidRequest, ServerUnavailable
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc
from queue_client.wire.codes import error_from_rpc

# Retry jitter from a generator of our own: a trainer's seeded global `random` is never
# drawn from by the client's background threads.
_JITTER = random.Random()

_BACKOFF_S = (0.05, 2.0)
# Long enough for a server that is still binding; short enough that a wrong address fails
# within 5 s, probe included.
CONNECT_TIMEOUT_S = 3.0
_PROBE_TIMEOUT_S = 0.5
TLS_CA_ENV = "BATCHQUEUE_TLS_CA_FILE"


def tls_credentials(ca_file: str | Path | None) -> grpc.ChannelCredentials | None:
    """Credentials that trust the certificates in `ca_file` (else $BATCHQUEUE_TLS_CA_FILE);
    None, for a plaintext channel, when neither is set."""
    path = ca_file if ca_file is not None else os.environ.get(TLS_CA_ENV)
    if not path:
        return None
    try:
        pem = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"tls_ca_file {str(path)!r} cannot be read: {exc.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise InvalidRequest(f"tls_ca_file {str(path)!r} holds no PEM certificate")
    return grpc.ssl_channel_credentials(root_certificates=pem)


def _tls_hint(tls: bool, why: str) -> str:
    """A TLS listener closes a plaintext connection at once: say what may be missing."""
    if not tls and "Socket closed" in why:
        return f"; if the server speaks TLS (server.tls_cert_file), pass tls_ca_file= or set ${TLS_CA_ENV}"
    return ""


class Rpc:
    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        reconnect_timeout_s: float = 30.0,
        tls_ca_file: str | Path | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.reconnect_timeout_s = reconnect_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connected = False
        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.enable_http_proxy", 0),
        ]
        credentials = tls_credentials(tls_ca_file)
        self.tls = credentials is not None
        self._channel = (
            grpc.secure_channel(address, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.BatchQueueStub(self._channel)
        token = auth_token if auth_token is not None else os.environ.get("BATCHQUEUE_TOKEN")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def call(
        self,
        method: str,
        request: Any,
        *,
        timeout_s: float = 30.0,
        reconnect_timeout_s: float | None = None,
    ) -> Any:
        """Call `method`, retrying only while the server is unreachable."""
        if not self._connected:
            self._connect(method)
        patience = self.reconnect_timeout_s if reconnect_timeout_s is None else reconnect_timeout_s
        deadline = time.monotonic() + patience
        delay = _BACKOFF_S[0]
        fn = getattr(self._stub, method)
        while True:
            try:
                return fn(request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=False)
            except grpc.RpcError as err:
                error = error_from_rpc(err, self.address)
                if (
                    not isinstance(error, ServerUnavailable)
                    or err.code() != grpc.StatusCode.UNAVAILABLE
                ):
                    raise error from None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerUnavailable(
                        f"batchqueue server at {self.address} is unreachable after {patience:.0f}s of retries "
                        f"({method}): {err.details()}"
                    ) from None
                # Backoff between reconnect attempts, not synchronisation: nothing else to wait on.
                time.sleep(min(remaining, delay * (0.5 + _JITTER.random())))
                delay = min(delay * 2, _BACKOFF_S[1])

    def stream(self, method: str, request: Any, *, timeout_s: float) -> Generator[Any, None, None]:
        """The messages of a server-streaming call, errors mapped as in call(). Not retried:
        a stream that breaks is the caller's to start again."""
        if not self._connected:
            self._connect(method)
        call = getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None
        finally:
            call.cancel()  # a caller that stops early ends the stream at once

    def _connect(self, method: str) -> None:
        """Wait for the first connection at most connect_timeout_s; ServerUnavailable naming
        the address and the last connection error if the server did not answer by then."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=self.connect_timeout_s)
        except grpc.FutureTimeoutError:
            ready.cancel()
            why = self._why_unreachable()
            if why is not None:
                raise ServerUnavailable(
                    f"batchqueue server at {self.address} did not answer within "
                    f"{self.connect_timeout_s:g}s (connect_timeout_s, calling {method}): {why}"
                    f"{_tls_hint(self.tls, why)}"
                ) from None
        self._connected = True

    def _why_unreachable(self) -> str | None:
        """The channel's last connection error, from one fail-fast Ping; None if the server
        answers after all (with any status but UNAVAILABLE or a deadline)."""
        try:
            self._stub.Ping(
                pb.PingRequest(),
                timeout=_PROBE_TIMEOUT_S,
                metadata=self._metadata,
                wait_for_ready=False,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return err.details() or "unavailable"
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "no connection could be made"
        return None

    def close(self) -> None:
        self._channel.close()
