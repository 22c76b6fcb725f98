"""An optional shared token for servers exposed beyond the host: `authorization: Bearer <t>`.

The health service stays open, so that container probes need no secret; it tells nothing
but SERVING or NOT_SERVING.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_OPEN_PREFIX = "/grpc.health.v1.Health/"


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if details.method.startswith(_OPEN_PREFIX):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if not hmac.compare_digest(sent_bytes, self._expected):
            return _deny(
                "missing or wrong token: send 'authorization: Bearer <token>' (server.auth_token)"
            )
        return await continuation(details)
