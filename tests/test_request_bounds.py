"""Every number of every request is bounded at the servicer's edge: out of range is
INVALID_ARGUMENT naming the field, its value and the range, before anything is journaled, and
the server (also restarted on the same data root) answers GetStats and AcquireLease after.

Once, an AcquireLease with seq near 2**63 made GetStats and AcquireLease fail with UNKNOWN
for good (the rank's next seq overflowed int64, and the journal kept it over restarts)."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import char_config
from queue_client import QueueClient, errors
from queue_client.format.batchfile import MAX_SEQ, BatchFileName
from queue_client.format.layout import DatasetLayout
from queue_client.streaming.resume import plan_resume
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.world import MAX_WORLD_SIZE, World
from queue_server.config.served_ranks import MAX_WORLD_SIZE as SERVER_MAX_WORLD_SIZE
from queue_server.journal.file import Journal
from queue_server.rpc import request_bounds

INT64 = (-(2**63), 2**63 - 1)


def acquire(**fields: Any) -> pb.AcquireLeaseRequest:
    return pb.AcquireLeaseRequest(
        **{"dataset": "chars", "split": "train", "client_id": "c", "wait_ms": 5000, **fields}
    )


# (method, request, the field the refusal must name, the value it must quote)
OUT_OF_RANGE = [
    ("AcquireLease", acquire(seq=2**63 - 1), "seq", 2**63 - 1),
    ("AcquireLease", acquire(seq=2**62), "seq", 2**62),
    ("AcquireLease", acquire(seq=MAX_SEQ + 1), "seq", MAX_SEQ + 1),
    ("AcquireLease", acquire(seq=-1), "seq", -1),
    ("AcquireLease", acquire(rank=-1), "rank", -1),
    ("AcquireLease", acquire(rank=2, world_size=2), "rank", 2),
    ("AcquireLease", acquire(rank=2**62, world_size=4), "rank", 2**62),
    ("AcquireLease", acquire(world_size=-1), "world_size", -1),
    ("AcquireLease", acquire(world_size=MAX_WORLD_SIZE + 1), "world_size", MAX_WORLD_SIZE + 1),
    ("AcquireLease", acquire(world_size=2**63 - 1), "world_size", 2**63 - 1),
    ("AcquireLease", acquire(wait_ms=-1), "wait_ms", -1),
    ("AcquireLease", acquire(wait_ms=request_bounds.MAX_WAIT_MS + 1), "wait_ms", 600_001),
    ("AcquireLease", acquire(wait_ms=2**63 - 1), "wait_ms", 2**63 - 1),
    (
        "ReleaseLease",
        pb.ReleaseLeaseRequest(lease_id="x", client_id="c", outcome=pb.CONSUMED, waited_s=-1.0),
        "waited_s",
        -1.0,
    ),
    (
        "ReleaseLease",
        pb.ReleaseLeaseRequest(lease_id="x", client_id="c", outcome=pb.CONSUMED, waited_s=1e300),
        "waited_s",
        1e300,
    ),
    (
        "ReleaseLease",
        pb.ReleaseLeaseRequest(
            lease_id="x", client_id="c", outcome=pb.CONSUMED, waited_s=float("nan")
        ),
        "waited_s",
        "nan",
    ),
    (
        "RenewLeases",
        pb.RenewLeasesRequest(client_id="c", lease_ids=["x"] * (request_bounds.MAX_LEASE_IDS + 1)),
        "lease_ids",
        request_bounds.MAX_LEASE_IDS + 1,
    ),
    (
        "SetCurriculum",
        pb.SetCurriculumRequest(dataset="chars", position_seq=2**63 - 1),
        "position_seq",
        2**63 - 1,
    ),
    (
        "SetCurriculum",
        pb.SetCurriculumRequest(dataset="chars", position_seq=-5),
        "position_seq",
        -5,
    ),
    ("SetCurriculum", pb.SetCurriculumRequest(dataset="chars", rank=-1), "rank", -1),
    (
        "SetCurriculum",
        pb.SetCurriculumRequest(dataset="chars", rank=MAX_WORLD_SIZE),
        "rank",
        MAX_WORLD_SIZE,
    ),
    ("SetCurriculum", pb.SetCurriculumRequest(dataset="chars", alpha=1.5), "alpha", 1.5),
    ("SetCurriculum", pb.SetCurriculumRequest(dataset="chars", alpha=float("inf")), "alpha", "inf"),
]


def _refusal(stub: Any, method: str, request: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
        f"{method}: {info.value.code().name}: {info.value.details()}"
    )
    return info.value.details() or ""


def _still_serves(server: Any) -> None:
    """GetStats answers with int64-safe numbers and a fresh client gets batches."""
    stats = server.split_stats("chars")
    assert stats["next_seq"] < 10**6
    with QueueClient(server.address, "chars", timeout_s=30) as client:
        for _ in range(7):
            client.get_batch("train")
    assert server.split_stats("chars")["consumed_files"] >= 1
    reply = server.stub.AcquireLease(acquire(client_id="after"), timeout=30)
    assert reply.seq < 10**6
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=reply.lease_id, client_id="after", outcome=pb.RETURNED),
        timeout=30,
    )


def _journaled(data_root: Path) -> list[dict[str, Any]]:
    layout = DatasetLayout(data_root, "chars")
    records = []
    for path in sorted(layout.journal_dir.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def test_out_of_range_fields_are_refused_by_name_and_the_server_keeps_serving(
    start_server, corpus: Path
) -> None:
    server = start_server(char_config(corpus))
    for method, request, name, value in OUT_OF_RANGE:
        details = _refusal(server.stub, method, request)
        assert name in details and str(value) in details, (method, name, details)
        assert "range" in details or "allowed" in details, details
    _still_serves(server)
    records = _journaled(server.data_root)
    assert records, "the journal holds what was served"
    assert all(r.get("e") != "alpha" for r in records), "a refused SetCurriculum was journaled"
    assert all(r.get("seq", 0) <= MAX_SEQ for r in records)

    # Restarted on the same data root (killed, so nothing is tidied up on the way out).
    server.kill(signal.SIGKILL)
    again = start_server(char_config(corpus), data_root=server.data_root)
    _still_serves(again)


def test_the_highest_allowed_seq_is_served_and_the_files_after_it_have_names(
    start_server, corpus: Path
) -> None:
    """MAX_SEQ itself is valid: the server makes that file and the window after it, every
    one with a name a restarted server reads back (10 digits of seq)."""
    server = start_server(char_config(corpus))
    lease = server.stub.AcquireLease(acquire(seq=MAX_SEQ), timeout=60)
    assert lease.seq == MAX_SEQ and f"-{MAX_SEQ:010d}-" in lease.path
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="c", outcome=pb.CONSUMED),
        timeout=30,
    )
    server.wait_ready_files("chars", 3)  # the rank's window past MAX_SEQ
    layout = DatasetLayout(server.data_root, "chars")
    names = [p.name for p in layout.queue_dir("train").iterdir() if not p.name.startswith(".")]
    assert names and all(BatchFileName.parse(n) is not None for n in names), names
    server.kill(signal.SIGKILL)
    # What the journal holds at the kill (a file renamed into place but not yet journaled is
    # removed at the restart by design, so the listing above can hold one more).
    with Journal(layout.journal_file("train")) as journal:
        summary = journal.replay()
    journaled_ready = set(summary.produced) - summary.consumed
    assert any(seq > MAX_SEQ for seq in journaled_ready), sorted(journaled_ready)
    again = start_server(char_config(corpus), data_root=server.data_root)
    stats = again.split_stats("chars")
    # Every file journaled before the kill was found again by its name.
    assert stats["seqs_missing"] == 0 and stats["ready_files"] >= len(journaled_ready)


# ---- the bounds module on its own --------------------------------------------------------

ints = st.one_of(
    st.integers(*INT64), st.sampled_from([INT64[0], INT64[1], -1, 0, MAX_SEQ, MAX_SEQ + 1])
)


@settings(max_examples=300, deadline=None)
@given(seq=ints, rank=ints, world_size=ints, wait_ms=ints)
@example(seq=2**63 - 1, rank=0, world_size=1, wait_ms=0)
@example(seq=MAX_SEQ, rank=0, world_size=0, wait_ms=600_000)
@example(seq=0, rank=MAX_WORLD_SIZE - 1, world_size=MAX_WORLD_SIZE, wait_ms=1)
def test_acquire_bounds_accept_exactly_the_allowed_ranges(
    seq: int, rank: int, world_size: int, wait_ms: int
) -> None:
    request = acquire(seq=seq, rank=rank, world_size=world_size, wait_ms=wait_ms)
    ws = world_size or 1
    problems = [
        name
        for name, ok in (
            ("wait_ms", 0 <= wait_ms <= 600_000),
            ("world_size", 0 <= world_size <= MAX_WORLD_SIZE),
            ("rank", 0 <= rank < ws),
            ("seq", 0 <= seq <= MAX_SEQ),
        )
        if not ok
    ]
    if not problems:
        request_bounds.check_acquire(request)
        return
    with pytest.raises(errors.InvalidRequest) as info:
        request_bounds.check_acquire(request)
    message = str(info.value)
    # The first field out of range, in the order they are checked, is named with its value.
    assert message.startswith(f"{problems[0]} "), message
    assert (
        str({"wait_ms": wait_ms, "world_size": world_size, "rank": rank, "seq": seq}[problems[0]])
        in message
    )


@settings(max_examples=200, deadline=None)
@given(
    position=st.one_of(st.none(), ints),
    rank=ints,
    alpha=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_set_curriculum_bounds(position: int | None, rank: int, alpha: float | None) -> None:
    request = pb.SetCurriculumRequest(dataset="d", rank=rank)
    if position is not None:
        request.position_seq = position
    if alpha is not None:
        request.alpha = alpha
    fine = (
        0 <= rank < MAX_WORLD_SIZE
        and (position is None or 0 <= position <= MAX_SEQ)
        and (alpha is None or (math.isfinite(alpha) and 0 <= alpha <= 1))
    )
    if fine:
        request_bounds.check_set_curriculum(request)
    else:
        with pytest.raises(errors.InvalidRequest, match=r"^(rank|position_seq|alpha) "):
            request_bounds.check_set_curriculum(request)


@settings(max_examples=200, deadline=None)
@given(waited=st.floats(allow_nan=True, allow_infinity=True))
def test_release_bounds(waited: float) -> None:
    request = pb.ReleaseLeaseRequest(lease_id="x", client_id="c", waited_s=waited)
    if math.isfinite(waited) and 0 <= waited <= request_bounds.MAX_WAITED_S:
        request_bounds.check_release(request)
    else:
        with pytest.raises(errors.InvalidRequest, match="waited_s"):
            request_bounds.check_release(request)


# ---- the client refuses them itself, before any call --------------------------------------


def test_the_world_bound_is_the_same_on_both_sides() -> None:
    assert MAX_WORLD_SIZE == SERVER_MAX_WORLD_SIZE


@pytest.mark.parametrize(
    ("rank", "world_size", "named"),
    [
        (0, MAX_WORLD_SIZE + 1, "world_size"),
        (0, 2**63, "world_size"),
        (-1, 4, "rank"),
        (4, 4, "rank"),
    ],
)
def test_the_client_refuses_a_bad_world_before_connecting(
    rank: int, world_size: int, named: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{named} .*\[") as info:
        QueueClient("127.0.0.1:1", "d", rank=rank, world_size=world_size)
    assert isinstance(info.value, errors.InvalidRequest)
    assert str(world_size if named == "world_size" else rank) in str(info.value)
    World(MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE)  # the largest world is fine


@pytest.mark.parametrize("field", ["seq", "next_seq"])
@pytest.mark.parametrize("value", [MAX_SEQ + 1, 2**63 - 1, -1])
def test_a_resume_state_with_an_impossible_seq_is_refused_by_name(field: str, value: int) -> None:
    position = {"seq": 0, "offset": 0, "next_seq": 1, "pending": []}
    position[field] = value
    state = {
        "version": 2,
        "dataset": "d",
        "config_fingerprint": "f00d",
        "rank": 0,
        "world_size": 1,
        "splits": {"train": position},
    }
    with pytest.raises(
        ValueError, match=rf"{field} is {value}, expected an int in \[0, {MAX_SEQ}\]"
    ):
        plan_resume(state, World(0, 1), "d", fingerprint="f00d", batches_per_file=5)


def test_every_string_field_of_every_request_has_a_declared_bound() -> None:
    """A string field added to a request must get its bound in MAX_CHARS (None: cut, never
    refused), so that no RPC takes a string of any length."""
    undeclared = [
        f"{method.input_type.name}.{field.name}"
        for method in pb.DESCRIPTOR.services_by_name["BatchQueue"].methods
        for field in method.input_type.fields
        if (
            field.type == field.TYPE_STRING
            or (field.message_type is not None and field.message_type.GetOptions().map_entry)
        )
        and field.name not in request_bounds.MAX_CHARS
    ]
    assert not undeclared, f"string fields without a bound in MAX_CHARS: {undeclared}"


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        (pb.RenewLeasesRequest(client_id="c" * 129), "client_id is 129 characters long"),
        (pb.RenewLeasesRequest(client_id="c", lease_ids=["a", "b" * 129]), "lease_ids[1] is 129"),
        (pb.GetStatsRequest(dataset="d" * 129), "dataset is 129 characters long"),
        (pb.GetSchemaRequest(dataset="d", split="s" * 65), "split is 65 characters long"),
        (pb.SetMixtureRequest(weights={"w" * 65: 1.0}), "a source name in weights is 65"),
    ],
)
def test_strings_over_their_bound_are_refused_by_length(request_: Any, named: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        request_bounds.check_strings(request_)
    assert str(info.value).startswith(named), info.value


def test_strings_at_their_bound_and_any_reason_pass() -> None:
    request_bounds.check_strings(
        pb.ReleaseLeaseRequest(lease_id="l" * 128, client_id="c" * 128, reason="r" * 100_000)
    )
    request_bounds.check_strings(pb.SetMixtureRequest(dataset="d" * 128, weights={"w" * 64: 1}))
