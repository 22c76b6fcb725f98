"""A split's control log read from its latest snapshot: a server that joins late gets the same
changes at the same seqs, and the same horizon, as one that read every record, in a few reads
instead of the whole log. A real store process (`queue-server control-store`), real clients.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.control_store import ControlStore

from conftest import subprocess_env
from queue_server.steering.log import CLAIM, MIXTURE, ControlLog, Entry
from queue_server.steering.store import TorchStore, parse_address

EVERY = 8


@pytest.fixture
def store(tmp_path: Path):
    hosted = ControlStore(tmp_path / "store", subprocess_env())
    host, port = parse_address(hosted.url, "test")
    clients: list[TorchStore] = []

    def connect() -> TorchStore:
        clients.append(TorchStore(host, port, timeout_s=30))
        return clients[-1]

    try:
        yield connect
    finally:
        for client in clients:
            client.close()
        hosted.kill()


def changes(entries: list[Entry]) -> list[tuple]:
    return [(e.index, e.kind, e.at, e.payload) for e in entries if e.kind != CLAIM]


def write(log: ControlLog, first: int, count: int) -> list[Entry]:
    """`count` records: claims of a growing horizon, a SetMixture now and then (some with the
    caller's position, whose seq depends on the claims before them)."""
    read: list[Entry] = []
    for i in range(first, first + count):
        if i % 7 == 3:
            record = {"kind": MIXTURE, "value": {"a": i, "b": 1}, "position": 5 * i,
                      "world_size": 2, "files_per_window": 2, "rank": 0}  # fmt: skip
        else:
            record = {"kind": CLAIM, "horizon": 4 * i, "by": "writer"}
        before, own = log.append(record)
        read += [*before, own]
    return read


def test_a_late_reader_starts_at_the_latest_snapshot_and_gets_what_reading_all_gives(
    store,
) -> None:
    prefix = "batchqueue/test/d/f/train/"
    writer = ControlLog(store(), prefix, EVERY)
    written = write(writer, 0, 45)
    late = ControlLog(store(), prefix, EVERY)
    whole = ControlLog(store(), prefix, 1 << 30)  # its snapshots would be at 2**30 records
    got, everything = late.read_new(), whole.read_new()
    assert whole.started_at == 0 and len(everything) == 45
    assert late.started_at == 40 and late.length == whole.length == 45
    assert changes(got) == changes(everything) == changes(written)
    assert late.horizon == whole.horizon == writer.horizon
    # The 5 records past snapshot 5 and the miss after them, the search (1, 2, 4, 8, 6, 5),
    # snapshots 4 to 1 for their changes, the record before snapshot 5's boundary.
    assert late.gets == 6 + 6 + 4 + 1
    assert whole.gets >= 45
    assert late.same_store()
    # Read on: records past the snapshot come in order, and the late reader appends too.
    more = write(writer, 45, 20)
    assert changes(late.read_new()) == changes(more)
    assert changes(write(late, 65, 3)) == changes(writer.read_new())
    assert late.horizon == writer.horizon


def test_every_server_puts_the_same_snapshot_and_one_that_does_not_fit_is_passed_over(
    store,
) -> None:
    prefix = "batchqueue/test/d/f/val/"
    a, b = ControlLog(store(), prefix, EVERY), ControlLog(store(), prefix, EVERY)
    written = write(a, 0, 2 * EVERY)
    b.read_new()  # b read past both boundaries too, and put what a had put
    reader = store()
    for number in (1, 2):  # each holds the changes since the one before, with their seqs
        body = reader.get(f"{prefix}snapshot-{EVERY}/{number}")
        assert body is not None
        doc = json.loads(body)
        assert doc["records"] == number * EVERY
        since = [e for e in written if e.kind != CLAIM and (number - 1) * EVERY <= e.index]
        assert [(c["index"], c["at"]) for c in doc["changes"]] == [
            (e.index, e.at) for e in since if e.index < number * EVERY
        ]
    assert doc["horizon"] == b.horizon
    # A snapshot that does not fit its records (written by another build) is passed over,
    # and the whole log is read; a server set to another interval has snapshots of its own.
    reader.put_if_absent(f"{prefix}snapshot-{EVERY // 2}/8", b'{"records": 3}')
    other = ControlLog(store(), prefix, EVERY // 2)
    assert len(other.read_new()) == 2 * EVERY and other.started_at == 0
    theirs = reader.get(f"{prefix}snapshot-{EVERY // 2}/4")
    assert theirs is not None and json.loads(theirs)["records"] == 2 * EVERY
