"""Method handlers whose requests that fail to parse are answered INVALID_ARGUMENT.

The generated `add_*Servicer_to_server` functions parse each request with the message's
FromString, so bytes that are not the message raise DecodeError inside gRPC, which answers
UNKNOWN with a Python traceback's words. Here BatchQueue's handlers are built from the
service descriptor, and a request that fails to parse reaches the servicer as an
UndecodableRequest, which its error translation (rpc/servicer.py) refuses as InvalidRequest
naming the message type. The standard services (health, reflection) are registered through
DecodingGuard, which wraps the handlers their generated code makes so that the same request
is refused, naming the method, before their servicer sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError, Message

from queue_client.errors import InvalidRequest
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.wire.codes import status_for

SERVICE = pb.DESCRIPTOR.services_by_name["BatchQueue"]


@dataclass(frozen=True)
class UndecodableRequest:
    """What a request that failed to parse arrives as."""

    message_type: str
    size_bytes: int
    error: str
    method: str = ""  # given for the standard services: their .proto is not ours

    def refuse(self) -> InvalidRequest:
        if self.method:
            return InvalidRequest(
                f"the request ({self.size_bytes} bytes) to {self.method} is not a valid "
                f"{self.message_type} message: {self.error}; send the message its service's "
                ".proto defines"
            )
        return InvalidRequest(
            f"the request ({self.size_bytes} bytes) is not a valid {self.message_type} "
            f"message: {self.error}; send the message batchqueue.proto defines"
        )


def _parser(cls: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | UndecodableRequest:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(name, len(data), str(exc) or "it does not parse")

    return parse


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every BatchQueue method of `servicer` on `server`, as the generated code
    would, but with the parsers above."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


class DecodingGuard:
    """Stands for a server in a generated `add_*Servicer_to_server(servicer, guard)`: the
    handlers it registers reach the server with their parsing made safe (`guarded`)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(
            service, {name: guarded(f"/{service}/{name}", h) for name, h in handlers.items()}
        )


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._made: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(details)
        if handler is None:
            return None
        made = self._made.get(details.method)
        if made is None:
            made = self._made[details.method] = guarded(details.method, handler)
        return made


def guarded(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` of `method` ("/package.Service/Name"), with a request that fails to parse
    refused INVALID_ARGUMENT naming the method and its message type, for each of the four
    kinds of call (a streamed request is checked as each message arrives)."""
    parse = handler.request_deserializer
    if parse is None:  # raw bytes: nothing to fail
        return handler
    message_type = _input_type(method)

    def safe(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(
                message_type, len(data), str(exc) or "it does not parse", method
            )

    replies = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _checked_unary(handler.unary_unary), safe, replies
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _checked_unary(handler.unary_stream), safe, replies
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _checked_stream(handler.stream_unary), safe, replies
        )
    assert handler.stream_stream is not None  # the fourth kind: one of them is set
    return grpc.stream_stream_rpc_method_handler(
        _checked_stream(handler.stream_stream), safe, replies
    )


def _input_type(method: str) -> str:
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        found = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    except KeyError:
        return "request"
    return found.input_type.full_name if found is not None else "request"


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, UndecodableRequest):
        code, message = status_for(request.refuse())
        await context.abort(code, message)


def _checked_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A request-unary behaviour, in the same form as the original (gRPC tells an async
    generator's streamed replies from a coroutine's context.write by the function's kind)."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse(request, context)
            async for reply in behaviour(request, context):
                yield reply

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(request, context)
        return await behaviour(request, context)

    return call


def _checked_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A request-streaming behaviour whose requests are checked as they arrive."""

    async def requests(
        incoming: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in incoming:
            await _refuse(request, context)
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def stream(incoming: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for reply in behaviour(requests(incoming, context), context):
                yield reply

        return stream

    async def call(incoming: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(requests(incoming, context), context)

    return call
