"""The typed, versioned journal: round trips, today's format, yesterday's format, torn tails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from queue_client import errors
from queue_server import journal as journal_module
from queue_server.journal import (
    JOURNAL_VERSION,
    Advanced,
    AlphaChange,
    Consumed,
    Journal,
    Produced,
    Quarantined,
    decode,
    encode,
)

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
    with pytest.raises(errors.ConfigError, match="journal version 3, this one reads up to 2"):
        decode(obj, "train.jsonl")
