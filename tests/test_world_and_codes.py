"""Rank arithmetic (world.py) and the error <-> gRPC status mapping (codes.py)."""

from __future__ import annotations

import inspect

import grpc
import pytest

import queue_client
from queue_client import errors
from queue_client.errors import InvalidRequest
from queue_client.wire import codes
from queue_client.world import World

# ---- World --------------------------------------------------------------------------------


def test_detect_defaults_to_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no RANK/WORLD_SIZE (or empty ones) the world is rank 0 of 1."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert World.detect() == World(0, 1)
    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "")
    assert World.detect() == World(0, 1)


def test_detect_reads_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK and WORLD_SIZE from the environment are used."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert World.detect() == World(2, 4)


def test_detect_explicit_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit rank and world_size override the environment, each on its own."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert World.detect(rank=1, world_size=2) == World(1, 2)
    assert World.detect(rank=3) == World(3, 4)
    assert World.detect(world_size=8) == World(2, 8)


def test_detect_explicit_values_skip_bad_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A garbage variable is not even read when an explicit value replaces it."""
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "many")
    assert World.detect(rank=0, world_size=1) == World(0, 1)


@pytest.mark.parametrize(("var", "raw"), [("RANK", "abc"), ("WORLD_SIZE", "1.5"), ("RANK", "0x1")])
def test_detect_invalid_environment_names_variable_and_value(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str
) -> None:
    """A non-integer variable raises InvalidRequest naming the variable and its value."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(var, raw)
    with pytest.raises(InvalidRequest, match=var) as info:
        World.detect()
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize(
    ("rank", "world_size", "needle"),
    [
        (2, 2, "rank 2"),
        (-1, 2, "rank -1"),
        (0, 0, "world_size 0"),
        (0, -3, "world_size -3"),
        ("0", 1, "rank '0'"),
    ],
)
def test_invalid_world_names_value(rank: object, world_size: object, needle: str) -> None:
    """Out-of-range or non-int rank/world_size raise InvalidRequest naming the value."""
    with pytest.raises(InvalidRequest, match=needle):
        World(rank, world_size)  # type: ignore[arg-type]


def test_detect_environment_rank_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK >= WORLD_SIZE from the environment is refused like an explicit one."""
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InvalidRequest, match="rank 4"):
        World.detect()


def test_owns_partitions_seqs() -> None:
    """Every seq is owned by exactly one rank: the one congruent to it modulo W."""
    for w in range(1, 6):
        worlds = [World(r, w) for r in range(w)]
        for seq in range(30):
            owners = [wd.rank for wd in worlds if wd.owns(seq)]
            assert owners == [seq % w]


def test_first_seq_at_or_after_exhaustive() -> None:
    """The result is the smallest seq >= the input that the rank owns."""
    for w in range(1, 6):
        for r in range(w):
            world = World(r, w)
            for seq in range(21):
                got = world.first_seq_at_or_after(seq)
                assert got >= seq
                assert got % w == r
                assert got - seq < w
                assert world.owns(got)
                assert not any(world.owns(s) for s in range(seq, got))


# ---- codes --------------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    """A stand-in for a transport error object: what grpc raises for a failed call."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


ERROR_CLASSES = sorted(
    (
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, errors.BatchQueueError)
    ),
    key=lambda c: c.__name__,
)


def test_error_class_list_is_complete() -> None:
    """Sanity: the round trip below covers every error queue_client exports, and more than one."""
    names = [n for n in queue_client.__all__ if n not in ("QueueClient", "LegacyClient")]
    exported = {getattr(queue_client, n) for n in names}
    exported = {c for c in exported if inspect.isclass(c) and issubclass(c, errors.BatchQueueError)}
    assert len(exported) > 10
    assert exported <= set(ERROR_CLASSES)


@pytest.mark.parametrize(
    "cls", [c for c in ERROR_CLASSES if c is not errors.BatchQueueError], ids=lambda c: c.__name__
)
def test_every_specific_error_has_a_status_code(cls: type[errors.BatchQueueError]) -> None:
    """No domain error falls through to INTERNAL: each has a deliberate status code."""
    code, _ = codes.status_for(cls("x"))
    assert code != grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_round_trips_through_status(cls: type[errors.BatchQueueError]) -> None:
    """status_for then error_from_rpc gives back the same class (and, bar transport errors, message)."""
    message = "dataset 'x': something went wrong: details"
    code, details = codes.status_for(cls(message))
    assert isinstance(code, grpc.StatusCode)
    back = codes.error_from_rpc(FakeRpcError(code, details), "localhost:1")
    assert type(back) is cls
    if cls is errors.ServerUnavailable:
        assert "localhost:1" in str(back)
    else:
        assert str(back) == message


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.SchemaMismatch, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.UnknownDataset, grpc.StatusCode.NOT_FOUND),
        (errors.UnknownLease, grpc.StatusCode.NOT_FOUND),
        (errors.LeaseConflict, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.CorruptBatchFile, grpc.StatusCode.DATA_LOSS),
        (errors.NoBatchReady, grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
        (errors.ServerUnavailable, grpc.StatusCode.UNAVAILABLE),
        (errors.BatchQueueError, grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes(cls: type[errors.BatchQueueError], code: grpc.StatusCode) -> None:
    """Each error maps to its documented status code, with the class name leading the message."""
    got_code, details = codes.status_for(cls("boom"))
    assert got_code == code
    assert details == f"{cls.__name__}: boom"


def test_unavailable_names_address() -> None:
    """UNAVAILABLE is a ServerUnavailable naming the address, whatever the details say."""
    err = codes.error_from_rpc(
        FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), "h:9"
    )
    assert isinstance(err, errors.ServerUnavailable)
    assert "h:9" in str(err) and "connection refused" in str(err)


def test_deadline_without_class_is_server_unavailable() -> None:
    """A bare DEADLINE_EXCEEDED (the transport timed out) is ServerUnavailable, not NoBatchReady."""
    err = codes.error_from_rpc(
        FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:9"
    )
    assert isinstance(err, errors.ServerUnavailable)
    assert "h:9" in str(err)


def test_unauthenticated_is_permission_denied() -> None:
    """UNAUTHENTICATED (a missing token) is PermissionDenied naming the address."""
    err = codes.error_from_rpc(FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "bad token"), "h:9")
    assert isinstance(err, errors.PermissionDenied)
    assert "h:9" in str(err) and "bad token" in str(err)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.UnknownDataset),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidRequest),
        (grpc.StatusCode.DATA_LOSS, errors.CorruptBatchFile),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    ],
)
def test_details_without_class_fall_back_to_code(code: grpc.StatusCode, cls: type) -> None:
    """Details that don't start with an error class name map by status code."""
    err = codes.error_from_rpc(FakeRpcError(code, "plain message"), "h:9")
    assert type(err) is cls
    assert str(err) == "plain message"


@pytest.mark.parametrize("details", ["annotations: x", "Exception: x", "grpc: x", "nothing here"])
def test_non_error_names_in_details_are_not_instantiated(details: str) -> None:
    """Only BatchQueueError subclasses are built from a name in the details."""
    err = codes.error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "h:9")
    assert type(err) is errors.BatchQueueError
    assert "RESOURCE_EXHAUSTED" in str(err) and "h:9" in str(err)


def test_missing_details_use_str_of_error() -> None:
    """An error with no details still yields a message."""
    err = codes.error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None), "h:9")
    assert isinstance(err, errors.ServerUnavailable)
    assert "h:9" in str(err)
