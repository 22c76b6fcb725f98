"""batchqueue's exceptions, shared by server and client.

Domain code raises these; the servicer maps each to one gRPC status code and the client maps
the code back to the same class (see `codes.py`), so a caller catches the same exception
whether the fault was found locally or on the server.
"""

from __future__ import annotations


class BatchQueueError(Exception):
    """Base of every error batchqueue raises on purpose."""


class InvalidRequest(BatchQueueError, ValueError):
    """A request field is malformed: a dataset name that would leave the data root, a rank
    outside [0, world_size), an unknown release outcome. Fix the caller; retrying won't help."""


class UnknownDataset(BatchQueueError, LookupError):
    """The dataset is not served: check the server config's [datasets.NAME] tables."""


class UnknownSplit(BatchQueueError, LookupError):
    """The split is not one the dataset declares (usually "train" and "val")."""


class UnknownLease(BatchQueueError, LookupError):
    """The lease is unknown: it expired, was released already, or the server restarted.
    Acquire the file again."""


class LeaseConflict(BatchQueueError):
    """The request conflicts with the queue's state: the lease belongs to another client, or
    the world size differs from that of the ranks holding leases now."""


class NotServed(BatchQueueError):
    """This server does not serve the rank, or not at that world size: it was started for
    other ranks (server.ranks, one server per node). The message names the ranks it serves;
    connect the rank to the server of its node."""


class ProviderFailed(BatchQueueError):
    """The dataset's provider failed repeatedly; its last error is in the message and in
    GetStats. Fix the provider or its config and restart the server."""


class NoBatchReady(BatchQueueError, TimeoutError):
    """No batch file became ready within the wait: the provider is slower than the trainer,
    or has stopped. GetStats shows which."""


class ServerUnavailable(BatchQueueError, ConnectionError):
    """The server could not be reached at the address given, after bounded retries."""


class ServerBusy(BatchQueueError):
    """The server is at one of its limits (server.max_fetch_streams: FetchFile streams open at
    once); the message names it. Retry after a backoff, or raise the limit."""


class PermissionDenied(BatchQueueError, PermissionError):
    """A missing or wrong auth token, or a path outside the data root."""


class ConfigError(BatchQueueError, ValueError):
    """The server config is malformed; the message names the key, the value and what was expected."""


class MetaError(BatchQueueError, ValueError):
    """meta.pkl is missing, unreadable, holds something other than plain data, or lacks a
    required key; the message names the keys."""


class SchemaMismatch(BatchQueueError, ValueError):
    """A batch does not match the declared schema; the message names the field."""


class CorruptBatchFile(BatchQueueError):
    """A batch file failed to load or to verify. The client reports it, the server moves it to
    quarantine/ and serves the next file."""
