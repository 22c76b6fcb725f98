"""Journal compaction: a compacted journal replays to the state the whole journal gives, a
crash between its steps leaves a journal that replays to the same state, memory stops growing
with the files read, and a real server compacts, restarts and serves every file once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from auditor import audit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import subprocess_env
from queue_server.journal import compaction
from queue_server.journal.file import Journal
from queue_server.journal.reconcile import fill_state, remove_journal_temps
from queue_server.journal.records import (
    Advanced,
    AlphaChange,
    Consumed,
    JournalSummary,
    Produced,
    Quarantined,
    Record,
)
from queue_server.split.state import FileEntry, SplitState

# ---- a model of what a split journals ------------------------------------------------------


@dataclass
class Model:
    """Records as production and clients write them: each slot's forward stream in order,
    each rank reading its own seqs in order, files made again after a quarantine or a rewind."""

    slots: int
    world: int
    stateful: bool
    next_forward: list[int] = field(default_factory=list)
    next_read: list[int] = field(default_factory=list)
    on_disk: set[int] = field(default_factory=set)
    made: dict[int, dict[str, Any]] = field(default_factory=dict)
    generation: int = 0

    def __post_init__(self) -> None:
        self.next_forward = list(range(self.slots))
        self.next_read = list(range(self.world))

    def floor(self) -> int:
        """compaction.settled_floor of these in-order reads."""
        w = self.world
        return min(n - w + 1 if n > r else r for r, n in enumerate(self.next_read))

    def states(self, seq: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.stateful:
            return {}, {}
        return {"cursor": seq * 10}, {"cursor": seq * 10 + 10}

    def step(self, op: int, pick: int) -> Record | None:
        self.generation += 1
        if op == 0 or op == 1:  # the forward stream of a slot
            slot = pick % self.slots
            seq = self.next_forward[slot]
            self.next_forward[slot] += self.slots
            before, after = self.states(seq)
            if op == 1 and self.stateful:
                self.made[seq] = {}
                return Advanced(seq, slot, before, after)
            self.made[seq] = {}
            self.on_disk.add(seq)
            return Produced(
                seq, f"{seq}-{self.generation}.pt", 100 + seq, seq, slot, True, before, after
            )
        if op == 2:  # a rank reads its next seq, if it is on disk
            rank = pick % self.world
            seq = self.next_read[rank]
            if seq not in self.on_disk:
                return None
            self.on_disk.discard(seq)
            self.next_read[rank] += self.world
            return Consumed(seq, self.world)
        if op == 3:  # a file on disk found corrupt
            if not self.on_disk:
                return None
            seq = sorted(self.on_disk)[pick % len(self.on_disk)]
            self.on_disk.discard(seq)
            return Quarantined(seq, f"bad {seq}")
        if op == 4:  # made again: after a quarantine, or a rank that rewound
            # Not past every rank's position (the floor): a seq read again from below it is
            # counted as read twice, by design (docs/guarantees.md).
            gone = sorted(s for s in self.made if s not in self.on_disk and s >= self.floor())
            if not gone:
                return None
            seq = gone[pick % len(gone)]
            self.on_disk.add(seq)
            before, after = self.states(seq)
            return Produced(
                seq,
                f"{seq}-{self.generation}.pt",
                100 + seq,
                seq,
                seq % self.slots,
                False,
                before,
                after,
            )
        return AlphaChange(pick, None if pick % 3 == 0 else (pick % 10) / 10, pick % self.world)


def state_of(summary: JournalSummary) -> SplitState:
    """The split's memory after a start: the journal's state, its on-disk files present."""
    state = SplitState()
    fill_state(summary, state)
    state.files = {
        s: FileEntry(s, e.name, e.size_bytes, e.crc32) for s, e in summary.produced.items()
    }
    return state


def facts_of(summary: JournalSummary) -> compaction.Facts:
    return compaction.Facts(
        summary.world_size,
        dict(summary.last_consumed),
        list(summary.alpha_changes),
        summary.records,
    )


def compact(journal: Journal, keep_seqs: int, slots: int) -> SplitState:
    """What a server does at start: replay, compact, and fold its memory the same way."""
    summary = journal.replay()
    journal.open()
    state, facts = state_of(summary), facts_of(summary)
    floor = compaction.settled_floor(
        facts.world_size, facts.last_consumed, range(facts.world_size), state.floor
    )
    compaction.compact_now(journal, state, facts, floor=floor, keep_seqs=keep_seqs, slots=slots)
    return state


def assert_same_state(whole: Journal, compacted: Journal, keep_seqs: int) -> None:
    """Everything a restarted server uses is the same in both journals' replays."""
    a, b = whole.replay(), compacted.replay()
    floor = b.floor
    assert state_of(a).accounting() == state_of(b).accounting()
    for name in ("produced_count", "reproduced_count", "consumed_count", "quarantined_count"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.produced_bytes == b.produced_bytes
    assert (a.world_size, a.last_consumed, a.alpha_changes) == (
        b.world_size,
        b.last_consumed,
        b.alpha_changes,
    )
    described = {s: (e.name, e.size_bytes, e.crc32, e.slot) for s, e in a.produced.items()}
    assert described == {s: (e.name, e.size_bytes, e.crc32, e.slot) for s, e in b.produced.items()}
    assert b.consumed <= a.consumed and all(s < floor for s in a.consumed - b.consumed)
    assert set(b.quarantined) <= set(a.quarantined)
    assert all(s < floor for s in set(a.quarantined) - set(b.quarantined))
    assert {k: v[0] for k, v in a.last_forward.items()} == {
        k: v[0] for k, v in b.last_forward.items()
    }
    for slot, (_seq, offset) in a.last_forward.items():
        assert whole.read_states(offset) == compacted.read_states(b.last_forward[slot][1])
    sb = state_of(b)
    for seq, offset in {**a.advanced, **a.offsets}.items():
        states = whole.read_states(offset)
        needed = seq >= floor or seq in a.produced
        kept_for_rewind = seq >= floor - keep_seqs and (states[0] or states[1])
        if needed or kept_for_rewind:
            where = sb.state_offset(seq)
            assert where is not None, f"seq {seq}'s states were dropped"
            assert compacted.read_states(where, seq) == states


RECORDS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), min_size=1, max_size=80)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    slots=st.integers(1, 3),
    world=st.integers(1, 3),
    stateful=st.booleans(),
    steps=RECORDS,
    more=RECORDS,
    cut=st.floats(0, 1),
    keep_seqs=st.integers(0, 12),
)
def test_a_compacted_journal_replays_to_the_same_state(
    tmp_path_factory: Any,
    slots: int,
    world: int,
    stateful: bool,
    steps: list[tuple[int, int]],
    more: list[tuple[int, int]],
    cut: float,
    keep_seqs: int,
) -> None:
    """Random record sequences: compact once part way and again at the end, appending in
    between; each time the compacted journal and its server memory agree with the whole one."""
    root = tmp_path_factory.mktemp("j")
    model = Model(slots, world, stateful)
    whole, compacted = Journal(root / "whole.jsonl"), Journal(root / "train.jsonl")

    def append(step: tuple[int, int]) -> None:
        record = model.step(*step)
        if record is not None:
            whole.append(record)
            compacted.append(record)

    split = int(len(steps) * cut)
    for step in steps[:split]:
        append(step)
    memory = compact(compacted, keep_seqs, slots)
    assert_same_state(whole, compacted, keep_seqs)
    for step in steps[split:] + more:
        append(step)
    memory = compact(compacted, keep_seqs, slots)
    assert_same_state(whole, compacted, keep_seqs)
    # The server's folded memory is what the compacted journal replays to.
    replayed = state_of(compacted.replay())
    for name in ("offsets", "advanced", "states_only", "consumed", "quarantined", "floor"):
        assert getattr(memory, name) == getattr(replayed, name), name
    assert memory.folded == replayed.folded and memory.last_forward == replayed.last_forward
    whole.close()
    compacted.close()


def test_appends_during_a_compaction_land_after_it(tmp_path: Path) -> None:
    """A compaction plans, writes in a thread while records are still appended, then swaps:
    the records appended meanwhile are in the new journal, and the folded memory points at
    them, exactly as a replay of the new journal does."""
    model = Model(slots=2, world=2, stateful=True)
    whole, journal = Journal(tmp_path / "whole.jsonl"), Journal(tmp_path / "train.jsonl")
    steps = [(op, i) for i in range(60) for op in (0, 0, 2, 2)]
    for step in steps[:150]:
        if (record := model.step(*step)) is not None:
            whole.append(record)
            journal.append(record)
    summary = journal.replay()
    journal.open()
    state, facts = state_of(summary), facts_of(summary)
    floor = compaction.settled_floor(2, facts.last_consumed, range(2), 0)
    assert floor > 20
    plan = compaction.plan(state, facts, end=journal.size, floor=floor, keep_seqs=4, slots=2)
    written = compaction.write(journal, plan)
    for step in [*steps[150:], (4, 3), (3, 1)]:  # appended while the thread wrote
        if (record := model.step(*step)) is not None:
            whole.append(record)
            journal.append(record)
    # The server's memory has taken those records in meanwhile.
    live = journal.replay()
    state = state_of(live)
    base = journal.replace_with(written.path, plan.end)
    compaction.apply(state, plan, written, base)
    assert_same_state(whole, journal, keep_seqs=4)
    replayed = state_of(journal.replay())
    for name in ("offsets", "advanced", "states_only", "consumed", "quarantined", "last_forward"):
        assert getattr(state, name) == getattr(replayed, name), name
    whole.close()
    journal.close()


def test_a_crash_at_any_step_leaves_a_journal_that_replays_the_same(tmp_path: Path) -> None:
    """Killed after the temp file is written but before the rename: the old journal is whole
    and the next start removes the temp file. Killed after the rename: the new one is whole.
    A real process is SIGKILLed between the steps."""
    path = tmp_path / "journal" / "train.jsonl"
    model = Model(slots=1, world=1, stateful=True)
    with Journal(path) as journal:
        for i in range(40):
            for op in (0, 2):
                if (record := model.step(op, i)) is not None:
                    journal.append(record)
    before = path.read_bytes()
    expected = state_of(Journal(path).replay()).accounting()
    script = f"""
        import os, sys
        from pathlib import Path
        from queue_server.journal import compaction
        from queue_server.journal.file import Journal
        from queue_server.journal.reconcile import fill_state
        from queue_server.split.state import FileEntry, SplitState
        journal = Journal(Path({str(path)!r}))
        summary = journal.replay()
        journal.open()
        state = SplitState()
        fill_state(summary, state)
        state.files = {{s: FileEntry(s, e.name, 0, 0) for s, e in summary.produced.items()}}
        facts = compaction.Facts(summary.world_size, dict(summary.last_consumed))
        plan = compaction.plan(state, facts, end=journal.size, floor=30, keep_seqs=2, slots=1)
        written = compaction.write(journal, plan)
        if sys.argv[1] == "after-write":
            os.kill(os.getpid(), 9)
        journal.replace_with(written.path, plan.end)
        os.kill(os.getpid(), 9)
    """
    env = subprocess_env()
    for stage in ("after-write", "after-rename"):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), stage], env=env, capture_output=True
        )
        assert proc.returncode == -9, proc.stderr.decode()
        journal = Journal(path)
        temps = [p for p in path.parent.iterdir() if p.name != path.name]
        if stage == "after-write":
            assert path.read_bytes() == before and temps, "the old journal must be untouched"
            remove_journal_temps(journal)
            assert [p.name for p in path.parent.iterdir()] == [path.name]
        else:
            assert len(path.read_bytes()) < len(before) / 2 and not temps
            assert json.loads(path.read_bytes().splitlines()[0])["e"] == "s"
        assert state_of(journal.replay()).accounting() == expected
        journal.close()


def test_memory_does_not_grow_with_the_files_read(tmp_path: Path) -> None:
    """Four thousand files made and read by 4 ranks, compacting every 250 records as a server
    does: what the split keeps per seq stays bounded by the windows and the keep window, not
    by the files read; the counts still add up."""
    for stateful, keep in ((False, 0), (True, 8)):
        model = Model(slots=2, world=4, stateful=stateful)
        journal = Journal(tmp_path / f"{stateful}.jsonl")
        state, facts = SplitState(), compaction.Facts()
        sizes = []
        for i in range(4_000):
            for step in ((0, i), (2, i)):
                record = model.step(*step)
                if record is None:
                    continue
                offset = journal.append(record)
                _apply(state, facts, record, offset)
            if facts.records >= 250:
                floor = compaction.settled_floor(4, facts.last_consumed, range(4), state.floor)
                compaction.compact_now(
                    journal, state, facts, floor=floor, keep_seqs=keep * 4, slots=2
                )
                sizes.append(
                    len(state.offsets)
                    + len(state.consumed)
                    + len(state.states_only)
                    + len(state.advanced)
                    + len(state.quarantined)
                )
        assert state.accounting()["seqs_produced"] >= 3_500
        assert state.accounting()["seqs_missing"] == 0
        assert max(sizes) < 300, sizes[-5:]
        assert max(sizes[len(sizes) // 2 :]) <= max(sizes[: len(sizes) // 2]) + 10
        assert journal.size < 300 * 200
        journal.close()


def _apply(state: SplitState, facts: compaction.Facts, record: Record, offset: int) -> None:
    """What production and releases do to a split's memory for one journaled record."""
    facts.records += 1
    if isinstance(record, Produced):
        state.counters.produced_files += 1
        state.offsets[record.seq] = offset
        state.files[record.seq] = FileEntry(record.seq, record.name, record.size_bytes, 0)
        prev = state.last_forward.get(record.slot)
        if record.forward and (prev is None or record.seq > prev[0]):
            state.last_forward[record.slot] = (record.seq, offset)
    elif isinstance(record, Consumed):
        state.counters.consumed_files += 1
        del state.files[record.seq]
        state.consumed.add(record.seq)
        facts.world_size = record.world_size
        rank = record.seq % record.world_size
        facts.last_consumed[rank] = max(record.seq, facts.last_consumed.get(rank, -1))


def test_an_old_journal_compacts_and_replays_the_same(tmp_path: Path) -> None:
    """Lines of the first format (no "v") fold into a snapshot like today's."""
    path = tmp_path / "train.jsonl"
    lines = []
    for seq in range(20):
        lines.append({"e": "p", "seq": seq, "name": f"{seq}.pt", "bytes": 5, "crc": 1, "w": 0})
        if seq < 15:
            lines.append({"e": "c", "seq": seq, "ws": 1})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with Journal(path) as journal:
        expected = state_of(journal.replay()).accounting()
        state = compact(journal, keep_seqs=0, slots=1)
        assert state.floor == 15 and set(state.offsets) == set(range(15, 20))
        assert state_of(journal.replay()).accounting() == expected


# ---- a real server ----------------------------------------------------------------------------

STREAM = textwrap.dedent(
    """
    [server]
    lease_ttl_s = 60
    [datasets.s]
    provider = "bq_test_providers:StreamProvider"
    batch_size = 2
    batches_per_file = 2
    journal_compact_records = 20
    journal_keep_files = 3
    """
)


def _read(server: Any, seq: int | None = None) -> tuple[int, list[int]]:
    """Lease rank 0's next file (or `seq`), read its x values, release it CONSUMED."""
    import grpc  # noqa: F401  (the stub's errors surface as grpc.RpcError)

    from queue_client.format.batchfile import load_batch_file
    from queue_client.wire import batchqueue_pb2 as pb

    request = pb.AcquireLeaseRequest(dataset="s", split="train", client_id="c", wait_ms=20_000)
    if seq is not None:
        request.seq = seq
    lease = server.stub.AcquireLease(request, timeout=30)
    values = load_batch_file(server.data_root / lease.path).tensors["x"].flatten().tolist()
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id="c", outcome=1), timeout=30
    )
    return lease.seq, values


def test_a_server_compacts_as_it_serves_and_a_restart_carries_on_exactly(start_server) -> None:
    """A streaming provider, compacting every 20 records: the journal stays short, a SIGKILLed
    server's restart carries each stream on exactly (no value skipped or repeated) and serves
    every file once, a rewind inside journal_keep_files gets the same bytes again, and one
    further back is refused naming the setting."""
    import grpc

    server = start_server(STREAM)
    path = server.data_root / "s" / "journal" / "train.jsonl"
    values: list[int] = []
    read: dict[int, list[int]] = {}
    for expected in range(40):
        seq, xs = _read(server)
        assert seq == expected
        read[seq] = xs
        values += xs
    first = json.loads(path.read_bytes().splitlines()[0])
    assert first["e"] == "s" and first["floor"] > 20, first
    assert path.stat().st_size < 40 * 250, "the journal was not compacted"
    audit(server, "s", consumed_seqs={"train": list(range(40))})
    server.kill()
    again = start_server(STREAM)
    for expected in range(40, 50):
        seq, xs = _read(again)
        assert seq == expected
        read[seq] = xs
        values += xs
    assert values == list(range(values[0], values[0] + len(values))), "a stream skipped or repeated"
    audit(again, "s", consumed_seqs={"train": list(range(50))})
    # A rank that rewinds to a checkpoint two files back gets the same bytes, made again.
    assert _read(again, 47) == (47, read[47])
    with pytest.raises(grpc.RpcError) as err:
        _read(again, 3)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "can no longer be made" in err.value.details()
    assert "journal_keep_files" in err.value.details()
