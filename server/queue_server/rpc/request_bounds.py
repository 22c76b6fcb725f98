"""Bounds on every number and every string of every request, checked at the servicer's edge.

Why here: a request is checked before anything is journaled or changes state. A seq near
2**63 once made every later reply overflow int64 (the rank's next seq is seq + world_size),
also after a restart, because the journal kept it. The bounds are what the rest of the
system can hold:

- seq and position_seq: below 10**9 (queue_client.format.batchfile.MAX_SEQ), so the files made in
  the windows past any of them still have names (a name holds 10 digits of seq), and seq
  arithmetic stays far inside int64 and exact in a float64 (JSON readers, numpy);
- world_size: at most queue_client.world.MAX_WORLD_SIZE (0 means 1), rank in [0, world_size);
  SetCurriculum's rank, which has no world size beside it, below MAX_WORLD_SIZE;
- wait_ms: ten minutes at most (the server caps its own wait at acquire_wait_s anyway);
- waited_s: a finite duration in [0, one day] (it feeds the wait histogram);
- alpha: a finite number in [0, 1];
- lease_ids: at most MAX_LEASE_IDS in one RenewLeases call; the releases an AcquireLease
  carries: at most MAX_CARRIED_RELEASES, each of the request's own client_id;
- every string field of every request (client_id, lease_id, each of lease_ids, dataset,
  split, each source name in SetMixture's weights): at most MAX_CHARS[field] characters,
  checked by check_strings for every RPC alike, refused naming the field and its length and
  never quoting it, so that no error ever quotes a long one back (a 16 KiB client_id once
  broke gRPC's metadata limit and came back RESOURCE_EXHAUSTED, and RenewLeases took one).

Ids are checked where they are looked up (an id nobody holds is NOT_FOUND, or lost in a
renewal), and ReleaseLease's outcome where the lease is (split/leases.py), before anything changes.
Each refusal here is InvalidRequest (INVALID_ARGUMENT) naming the field, its value and the
allowed range.
"""

from __future__ import annotations

import math

from google.protobuf.message import Message

from queue_client.errors import InvalidRequest
from queue_client.format.batchfile import MAX_SEQ
from queue_client.wire import batchqueue_pb2 as pb
from queue_client.world import MAX_WORLD_SIZE
from queue_server.split.leases import MAX_ID_LENGTH

MAX_WAIT_MS = 10 * 60 * 1000
MAX_LEASE_IDS = 10_000
# Releases one AcquireLease may carry: a reader finishes one file, or a few in a big batch.
MAX_CARRIED_RELEASES = 16
MAX_WAITED_S = 24 * 3600.0

__all__ = [
    "MAX_CHARS",
    "MAX_LEASE_IDS",
    "MAX_SEQ",
    "MAX_WAITED_S",
    "MAX_WAIT_MS",
    "MAX_WORLD_SIZE",
    "check_acquire",
    "check_explain_step",
    "check_int",
    "check_release",
    "check_renew",
    "check_set_curriculum",
    "check_set_mixture",
    "check_skip_steps",
    "check_strings",
]

# Sources of one mixture, and the length of a source name (mixture/config.py).
MAX_MIXTURE_SOURCES = 255
# SkipSteps: global steps up to this (steering/skips.py MAX_STEP).
MAX_STEP = 999_999_999_999
MAX_SOURCE_NAME = 64
# ExplainStep: the rows one reply may list.
MAX_EXPLAIN_ROWS = 65_536

# The most characters of each string field of a BatchQueue request, by the field's name
# (tests/test_request_bounds.py checks that every one is here). The names' own rules
# (layout.check_dataset_name, check_split_name) come after, with the same limits. reason is
# None: cut to REASON_CHARS, never refused, so that a report of a corrupt file is not lost
# for its length.
MAX_CHARS: dict[str, int | None] = {
    "client_id": MAX_ID_LENGTH,
    "dataset": 128,
    "lease_id": MAX_ID_LENGTH,
    "lease_ids": MAX_ID_LENGTH,
    "reason": None,
    "split": 64,
    "weights": MAX_SOURCE_NAME,  # the map's keys: source names
}
REASON_CHARS = 2000


def check_int(field: str, value: int, low: int, high: int, note: str = "") -> int:
    """`value`, or InvalidRequest naming the field, the value and [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(
            f"{field} {value!r} is outside the allowed range [{low}, {high}]{note}"
        )
    return value


def check_unit_interval(field: str, value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise InvalidRequest(f"{field} {value!r} is outside the allowed range [0, 1]")
    return value


def check_strings(request: Message) -> None:
    """Every string the request holds, by its length only (an empty one is refused where it
    matters), never quoting it: the first one over MAX_CHARS is InvalidRequest naming the
    field (lease_ids[3], a source name in weights) and its length."""
    for field, value in request.ListFields():
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            if entry.fields_by_name["key"].type != field.TYPE_STRING:
                continue
            texts = [(f"a source name in {field.name}", key) for key in value]
        elif field.type == field.TYPE_STRING:
            if isinstance(value, str):
                texts = [(field.name, value)]
            else:
                texts = [(f"{field.name}[{i}]", text) for i, text in enumerate(value)]
        else:
            continue
        limit = MAX_CHARS.get(field.name, MAX_ID_LENGTH)
        for what, text in texts:
            if limit is not None and len(text) > limit:
                raise InvalidRequest(
                    f"{what} is {len(text)} characters long; at most {limit} are allowed"
                )


def check_acquire(request: pb.AcquireLeaseRequest) -> None:
    """AcquireLease: wait_ms, world_size (0 means 1), rank, seq, and the releases it carries
    (at most MAX_CARRIED_RELEASES, each the request's client's, each as ReleaseLease's)."""
    check_int("wait_ms", request.wait_ms, 0, MAX_WAIT_MS, " (0 means the server's default)")
    check_int("world_size", request.world_size, 0, MAX_WORLD_SIZE, " (0 means 1)")
    world_size = request.world_size or 1
    check_int("rank", request.rank, 0, world_size - 1, f" of world_size {world_size}")
    if request.HasField("seq"):
        check_int("seq", request.seq, 0, MAX_SEQ)
    check_int("the number of releases", len(request.releases), 0, MAX_CARRIED_RELEASES)
    for i, release in enumerate(request.releases):
        check_strings(release)
        if release.client_id != request.client_id:
            raise InvalidRequest(
                f"releases[{i}] is of another client_id than the request's: an AcquireLease "
                "carries releases of its own client's leases only"
            )
        check_release(release)


def check_release(request: pb.ReleaseLeaseRequest) -> None:
    """ReleaseLease: waited_s (the outcome is checked with the lease, in split/leases.py)."""
    waited = request.waited_s
    if not (math.isfinite(waited) and 0.0 <= waited <= MAX_WAITED_S):
        raise InvalidRequest(
            f"waited_s {waited!r} is outside the allowed range [0, {MAX_WAITED_S:g}] seconds"
        )


def check_renew(request: pb.RenewLeasesRequest) -> None:
    """RenewLeases: at most MAX_LEASE_IDS ids (each unknown or empty one comes back lost)."""
    count = len(request.lease_ids)
    if count > MAX_LEASE_IDS:
        raise InvalidRequest(
            f"{count} lease_ids in one call; the allowed number is [0, {MAX_LEASE_IDS}]"
        )


def check_set_curriculum(request: pb.SetCurriculumRequest) -> None:
    """SetCurriculum: rank, position_seq, alpha."""
    check_int("rank", request.rank, 0, MAX_WORLD_SIZE - 1)
    if request.HasField("position_seq"):
        check_int("position_seq", request.position_seq, 0, MAX_SEQ)
    if request.HasField("alpha"):
        check_unit_interval("alpha", request.alpha)


def check_set_mixture(request: pb.SetMixtureRequest) -> None:
    """SetMixture: rank, position_seq, the number of the weights, reset (the names' lengths
    in check_strings)."""
    check_int("rank", request.rank, 0, MAX_WORLD_SIZE - 1)
    if request.HasField("position_seq"):
        check_int("position_seq", request.position_seq, 0, MAX_SEQ)
    if len(request.weights) > MAX_MIXTURE_SOURCES:
        raise InvalidRequest(
            f"{len(request.weights)} weights in one call; a mixture has at most "
            f"{MAX_MIXTURE_SOURCES} sources"
        )
    if request.reset and request.weights:
        raise InvalidRequest("reset = true goes back to the config's weights: send no weights")


def check_skip_steps(request: pb.SkipStepsRequest) -> None:
    """SkipSteps: rank, the steps and the caller's position (the range in steering/skips.py)."""
    check_int("rank", request.rank, 0, MAX_WORLD_SIZE - 1)
    if request.list_only:
        return
    check_int("from_step", request.from_step, 0, MAX_STEP)
    check_int("to_step", request.to_step, 0, MAX_STEP)
    check_int("position_step", request.position_step, 0, MAX_STEP)
    if request.HasField("position_seq"):
        check_int("position_seq", request.position_seq, 0, MAX_SEQ)


def check_explain_step(request: pb.ExplainStepRequest) -> None:
    """ExplainStep: world_size (0: the split's), rank, step, seq and offset, batch_size (the
    rows one reply lists, at most MAX_EXPLAIN_ROWS)."""
    check_int("world_size", request.world_size, 0, MAX_WORLD_SIZE, " (0 means the split's)")
    check_int("rank", request.rank, 0, (request.world_size or MAX_WORLD_SIZE) - 1)
    check_int("step", request.step, 0, MAX_STEP)
    if request.HasField("seq"):
        check_int("seq", request.seq, 0, MAX_SEQ)
    check_int("offset", request.offset, 0, MAX_SEQ)
    check_int("batch_size", request.batch_size, 0, MAX_EXPLAIN_ROWS, " (0 means the dataset's)")
