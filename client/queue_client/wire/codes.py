"""The one place where batchqueue errors and gRPC status codes meet, in both directions."""

from __future__ import annotations

import grpc

from queue_client import errors

_CODE_BY_ERROR: list[tuple[type[errors.BatchQueueError], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.SchemaMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnknownDataset, grpc.StatusCode.NOT_FOUND),
    (errors.UnknownSplit, grpc.StatusCode.NOT_FOUND),
    (errors.UnknownLease, grpc.StatusCode.NOT_FOUND),
    (errors.LeaseConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NotServed, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ProviderFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.MetaError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CorruptBatchFile, grpc.StatusCode.DATA_LOSS),
    (errors.NoBatchReady, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.ServerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ServerBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
]

# gRPC itself answers RESOURCE_EXHAUSTED too (a message over a size limit), which no retry
# mends: only the server's own ServerBusy, named in the details, is taken as one.
_BY_NAME_ONLY = (errors.ServerBusy,)

# The message carries the class name, so NOT_FOUND comes back as the right kind of not found.
_SEPARATOR = ": "


def status_for(exc: errors.BatchQueueError) -> tuple[grpc.StatusCode, str]:
    """The status code and message to send for a domain error."""
    for cls, code in _CODE_BY_ERROR:
        if isinstance(exc, cls):
            return code, f"{type(exc).__name__}{_SEPARATOR}{exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}{_SEPARATOR}{exc}"


def error_from_rpc(err: grpc.RpcError, address: str) -> errors.BatchQueueError:
    """The domain error for a failed call, naming the address for transport failures."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.ServerUnavailable(f"batchqueue server at {address} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and _SEPARATOR not in details:
        return errors.ServerUnavailable(f"batchqueue server at {address} did not answer in time")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.PermissionDenied(f"{address}: {details}")
    name, _, message = details.partition(_SEPARATOR)
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.BatchQueueError):
        return cls(message)
    for cls, mapped in _CODE_BY_ERROR:
        if mapped == code and cls not in _BY_NAME_ONLY:
            return cls(details)
    return errors.BatchQueueError(f"{code.name} from {address}: {details}")
