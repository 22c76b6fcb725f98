"""The BatchQueue service's method handlers, with requests that fail to parse answered
INVALID_ARGUMENT.

The generated `add_BatchQueueServicer_to_server` parses each request with the message's
FromString, so bytes that are not the message raise DecodeError inside gRPC, which answers
UNKNOWN with a Python traceback's words. Here the same handlers are built from the service
descriptor, and a request that fails to parse reaches the servicer as an UndecodableRequest,
which its error translation (rpc/servicer.py) refuses as InvalidRequest naming the message type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from queue_client.errors import InvalidRequest
from queue_client.wire import batchqueue_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["BatchQueue"]


@dataclass(frozen=True)
class UndecodableRequest:
    """What a request that failed to parse arrives as."""

    message_type: str
    size_bytes: int
    error: str

    def refuse(self) -> InvalidRequest:
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
