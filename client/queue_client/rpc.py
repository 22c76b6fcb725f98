"""The client's one door to the server: retries while the server is away, errors by name.

UNAVAILABLE (server restarting, not up yet) is retried with capped exponential backoff until
`reconnect_timeout_s` has passed, then becomes ServerUnavailable naming the address. Every
other failure maps to the batchqueue error the server raised (queue_client.codes).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import grpc

from queue_client.codes import error_from_rpc
from queue_client.errors import ServerUnavailable
from queue_client.wire import batchqueue_pb2_grpc as pb_grpc

_BACKOFF_S = (0.05, 2.0)


class Rpc:
    def __init__(
        self, address: str, *, auth_token: str | None = None, reconnect_timeout_s: float = 30.0
    ) -> None:
        self.address = address
        self.reconnect_timeout_s = reconnect_timeout_s
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.enable_http_proxy", 0),
            ],
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
                time.sleep(min(remaining, delay * (0.5 + random.random())))
                delay = min(delay * 2, _BACKOFF_S[1])

    def close(self) -> None:
        self._channel.close()
