"""The typed, versioned journal: round trips, today's format, yesterday's format, torn tails;
a journal lost under a running server or missing at start is named, never replaced."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from conftest import wait_until
from queue_client import errors
from queue_client.format.batchfile import MAX_SEQ
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.journal import records as journal_module
from queue_server.journal.file import Journal, JournalLost
from queue_server.journal.records import (
    JOURNAL_VERSION,
    Advanced,
    AlphaChange,
    Consumed,
    Produced,
    Quarantined,
    decode,
    encode,
)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

RECORDS = [
    Produced(0, "a.pt", 100, 7, 0, True, {"cursor": 1}, {"cursor": 2}),
    Produced(1, "b.pt", 110, 8, 1, True),
    Consumed(0, 2),
    Quarantined(1, "crc mismatch"),
    Produced(1, "c.pt", 110, 9, 1, False, {"cursor": 3}, {"cursor": 4}),
    AlphaChange(8, 0.5, 0),
    AlphaChange(16, None, 1),
    Advanced(3, 1, {"cursor": 5}, {"cursor": 6}),
]


@pytest.mark.parametrize("record", RECORDS)
def test_every_record_round_trips(record: object) -> None:
    line = encode(record)  # type: ignore[arg-type]
    obj = json.loads(line)
    assert obj["v"] == JOURNAL_VERSION and line.endswith(b"\n")
    assert decode(obj, "j") == record


def test_replay_summarises_the_records(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal" / "train.jsonl")
    offsets = [journal.append(r) for r in RECORDS]
    journal.close()
    with Journal(tmp_path / "journal" / "train.jsonl") as again:
        summary = again.replay()
    assert summary.produced_count == 2 and summary.reproduced_count == 1
    assert summary.consumed == {0} and summary.quarantined == {}
    assert set(summary.produced) == {1} and summary.produced[1].name == "c.pt"
    assert summary.offsets == {0: offsets[0], 1: offsets[4]}
    # An advanced seq is part of its slot's forward stream, but no produced file.
    assert summary.last_forward == {0: (0, offsets[0]), 1: (3, offsets[7])}
    assert summary.advanced == {3: offsets[7]} and 3 not in summary.produced
    assert summary.world_size == 2 and summary.last_consumed == {0: 0}
    assert summary.alpha_changes == [AlphaChange(8, 0.5, 0), AlphaChange(16, None, 1)]


def test_a_journal_from_before_versions_still_loads(tmp_path: Path) -> None:
    """Lines as the first format wrote them: no "v", the same keys."""
    path = tmp_path / "train.jsonl"
    lines = [
        {
            "e": "p",
            "seq": 0,
            "name": "x.pt",
            "bytes": 5,
            "crc": 1,
            "w": 0,
            "fwd": True,
            "before": {},
            "after": {"k": 1},
        },
        {"e": "p", "seq": 1, "name": "y.pt", "bytes": 5, "crc": 2, "w": 1},
        {"e": "c", "seq": 0, "ws": 1},
        {"e": "q", "seq": 1, "why": "bad"},
        {"e": "alpha", "at": 4, "alpha": 0.25, "rank": 0},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with Journal(path) as journal:
        summary = journal.replay()
        assert journal.read_states(summary.offsets[0]) == ({}, {"k": 1})
    assert summary.produced_count == 2 and summary.consumed == {0}
    assert summary.quarantined == {1: "bad"}
    assert summary.alpha_changes == [AlphaChange(4, 0.25, 0)]


def test_records_with_a_seq_out_of_range_are_skipped_at_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal written before requests were bounded may hold a seq near 2**63; replay
    skips such a record, says so, and keeps every other one, so the split serves again. A
    seq past MAX_SEQ that a file name holds (the window after the highest request) is kept."""
    path = tmp_path / "train.jsonl"
    lines = [
        {"v": 3, "e": "p", "seq": 0, "name": "x.pt", "bytes": 5, "crc": 1, "w": 0},
        {"v": 3, "e": "p", "seq": MAX_SEQ + 2, "name": "z.pt", "bytes": 5, "crc": 1, "w": 0},
        {"v": 3, "e": "c", "seq": 2**63 - 2, "ws": 1},
        {"v": 3, "e": "p", "seq": -5, "name": "y.pt", "bytes": 5, "crc": 1, "w": 0},
        {"v": 3, "e": "c", "seq": 0, "ws": 1},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level("WARNING", logger="queue_server.journal"), Journal(path) as journal:
        summary = journal.replay()
    assert summary.consumed == {0} and summary.produced_count == 2
    assert set(summary.produced) == {MAX_SEQ + 2}
    assert summary.last_consumed == {0: 0}
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2 and str(2**63 - 2) in skipped[0]


def test_a_newer_journal_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"v": JOURNAL_VERSION + 1, "e": "c", "seq": 0}) + "\n")
    with (
        Journal(path) as journal,
        pytest.raises(errors.ConfigError, match=r"train.jsonl was written by a newer batchqueue"),
    ):
        journal.replay()


def test_a_torn_tail_is_cut_so_the_next_record_survives(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    journal = Journal(path)
    journal.append(Consumed(0, 1))
    journal.close()
    with open(path, "ab") as f:
        f.write(b'{"e":"c","se')  # a crash in the middle of a line
    with Journal(path) as journal:
        assert journal.replay().consumed == {0}
        journal.append(Consumed(1, 1))
    with Journal(path) as journal:
        assert journal.replay().consumed == {0, 1}


def test_an_advanced_seq_can_be_made_again_from_its_states(tmp_path: Path) -> None:
    """A streaming slot passed seq 2 without a file (another node's rank); a rank that asks
    for it after all gets it made from the state journaled before it, and a restarted slot
    carries on from the state after it."""
    path = tmp_path / "train.jsonl"
    with Journal(path) as journal:
        journal.append(Produced(0, "a.pt", 10, 1, 0, True, {"at": 0}, {"at": 1}))
        journal.append(Advanced(2, 0, {"at": 1}, {"at": 2}))
        summary = journal.replay()
        assert journal.read_states(summary.advanced[2]) == ({"at": 1}, {"at": 2})
    assert summary.last_forward[0][0] == 2
    assert summary.produced_count == 1 and set(summary.offsets) == {0}


def test_a_reader_of_version_2_refuses_advanced_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Advanced records came with version 3: a version-2 reader would skip them and lose the
    stream position they hold, so it must refuse the journal instead."""
    obj = json.loads(encode(Advanced(2, 0)))
    monkeypatch.setattr(journal_module, "JOURNAL_VERSION", 2)
    with pytest.raises(errors.ConfigError, match=r"journal version [3-9], this one reads up to 2"):
        decode(obj, "train.jsonl")


# ---- a journal lost under a running server, or missing at start ------------------------------


def test_a_deleted_or_cut_journal_is_noticed_at_the_next_append(tmp_path: Path) -> None:
    """The file is checked before each append: deleted, replaced or cut shorter than what was
    written, the append raises JournalLost naming the file, and no new journal is begun."""
    path = tmp_path / "train.jsonl"
    journal = Journal(path)
    journal.append(Consumed(0, 1))
    path.unlink()
    with pytest.raises(JournalLost, match=r"train.jsonl was deleted while the server ran"):
        journal.append(Consumed(1, 1))
    assert not path.exists()
    journal.close()
    journal = Journal(path)
    journal.append(Consumed(0, 1))
    journal.append(Consumed(1, 1))
    os.truncate(path, 10)
    with pytest.raises(JournalLost, match=r"was cut to 10 bytes .*it had written \d+"):
        journal.append(Consumed(2, 1))
    journal.close()
    journal = Journal(path)
    journal.append(Consumed(0, 1))
    path.rename(tmp_path / "elsewhere.jsonl")
    path.write_bytes(b"")
    with pytest.raises(JournalLost, match="replaced by another file"):
        journal.append(Consumed(1, 1))
    journal.close()


TINY = textwrap.dedent(
    """
    [server]
    lease_ttl_s = 60
    [datasets.d]
    provider = "bq_test_providers:TinyProvider"
    batch_size = 2
    batches_per_file = 2
    """
)
CLIENT = "journal-test"


def _consume(server: Any) -> int:
    lease = server.stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset="d", split="train", client_id=CLIENT, wait_ms=10_000),
        timeout=30,
    )
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=CLIENT, outcome=pb.CONSUMED),
        timeout=30,
    )
    return lease.seq


@pytest.mark.parametrize("how", ["deleted", "cut"])
def test_a_journal_lost_while_serving_stops_the_split_by_name(start_server, how: str) -> None:
    """Deleted (or cut shorter) under a running server: the next append notices, the split
    stops (acquires UNAVAILABLE), and the log, GetStats and health name the journal; no new
    journal file is begun."""
    server = start_server(TINY)
    server.wait_ready_files("d", 2)
    _consume(server)
    path = server.data_root / "d" / "journal" / "train.jsonl"
    if how == "deleted":
        path.unlink()
    else:
        os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(grpc.RpcError) as err:
        _consume(server)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    said = {"deleted": "was deleted while the server ran", "cut": "was cut to"}[how]
    assert said in err.value.details() and str(path) in err.value.details()
    stats = server.split_stats("d")
    assert said in stats["journal_error"] and str(path) in stats["journal_error"]
    assert server.stats("d")["state"] == "unavailable" and said in server.stats("d")["last_error"]
    assert server.health("batchqueue.v1.BatchQueue/d") == NOT_SERVING
    assert said in server.log()
    assert path.exists() == (how == "cut")  # nothing new was begun in its place
    if how == "cut":
        assert path.stat().st_size < 1000


def test_a_journal_missing_at_start_beside_batch_files_fails_the_dataset_by_name(
    start_server,
) -> None:
    """Batch files without their journal: the start fails naming the journal and the files
    (the server exits 2 saying so; with --keep-serving, GetStats and health say so), and
    nothing on disk is touched (no file removed as unknown)."""
    server = start_server(TINY)
    server.wait_ready_files("d", 2)
    server.stop()
    path = server.data_root / "d" / "journal" / "train.jsonl"
    qdir = server.data_root / "d" / "queue" / "train"
    files = sorted(p.name for p in qdir.iterdir())
    path.unlink()
    exits = start_server(TINY, wait_serving=False)
    assert exits.proc.wait(timeout=60) == 2
    assert f"the journal {path} is missing" in exits.log()
    again = start_server(TINY, wait_serving=False, args=("--keep-serving",))
    stats = wait_until(
        lambda: (s := again.stats("d"))["state"] == "failed" and s, 60, "the dataset to fail"
    )
    assert f"the journal {path} is missing" in stats["last_error"]
    assert "queue-server reset" in stats["last_error"]
    assert again.health("batchqueue.v1.BatchQueue/d") == NOT_SERVING
    assert f"the journal {path} is missing" in again.log()
    assert sorted(p.name for p in qdir.iterdir()) == files and not path.exists()


def test_a_start_keeps_the_journaled_files_and_removes_the_unjournaled_ones(
    tmp_path: Path,
) -> None:
    """What a stop can leave: a file a worker published while the server was cancelling its
    job (never journaled), and a consumed file whose deletion the stop overtook. The next
    start keeps exactly the journal's view: nothing journaled is lost, nothing else stays."""
    from queue_client.format.batchfile import BatchFileName
    from queue_server.journal.reconcile import reconcile
    from queue_server.split.state import SplitState

    files, quarantine = tmp_path / "queue", tmp_path / "quarantine"
    files.mkdir()
    names = {seq: str(BatchFileName(1_000 + seq, seq, 2)) for seq in range(4)}
    for name in names.values():
        (files / name).write_bytes(b"batch")
    journal = Journal(tmp_path / "journal" / "train.jsonl")
    for seq in (0, 1, 2):
        journal.append(Produced(seq, names[seq], 5, 0, 0, True))
    journal.append(Consumed(0, 1))
    journal.close()
    state = SplitState()
    with Journal(journal.path) as again:
        reconcile(files, quarantine, again, state)
    assert sorted(state.files) == [1, 2]
    assert sorted(os.listdir(files)) == [names[1], names[2]]
    assert state.counters.orphans_removed == 2  # seq 0 (consumed) and seq 3 (unjournaled)


def test_a_clean_stop_leaves_exactly_the_journaled_files(start_server) -> None:
    """What a stop can leave behind (a file a worker published while the stop cancelled its
    job, never journaled) is removed by the stop itself, once the workers are gone; every
    journaled file stays. So the next start removes nothing, even one refused for a changed
    input, which must leave the data root as it found it."""
    from queue_client.format.batchfile import BatchFileName, scan_queue
    from queue_client.format.layout import DatasetLayout

    server = start_server(TINY)
    server.wait_ready_files("d", 2)
    layout = DatasetLayout(server.data_root, "d")
    qdir = layout.queue_dir("train")
    on_disk = scan_queue(qdir)  # published: journaled, or about to be (or never, if stopped)
    seq = max(n.seq for n in on_disk) + 1_000
    stray = qdir / str(BatchFileName(1_000, seq, 2))
    stray.write_bytes(b"a batch file no journal record names")
    cut_short = qdir / f".tmp-999999-0-{stray.name}"  # a write cut short, its writer gone
    cut_short.write_bytes(b"half a batch file")
    server.stop()
    left = sorted(p.name for p in qdir.iterdir())
    assert stray.name not in left, left
    assert not [n for n in left if n.startswith(".tmp")], (
        left
    )  # dead writers' temps too (temp_sweep.py)
    # Exactly the journal's waiting files: a file the stop cancelled after its worker had
    # published it (on disk above, never journaled) is gone with the strays, and no journaled
    # one is lost. Nothing was consumed here.
    with Journal(layout.journal_file("train")) as journal:
        summary = journal.replay()
    waiting = {e.name for seq, e in summary.produced.items() if seq not in summary.consumed}
    assert len(waiting) >= 2 and set(left) == waiting, (sorted(waiting), left)
