"""A journal that cannot be written puts its split in the disk-error state: it hands out
nothing, GetStats and health say why (the path and the errno text), nothing consumed is lost,
and it serves again by itself once writes succeed; a restart then replays every file once.

The first test fills a real filesystem: a small tmpfs mounted under tmp_path (root only; it
is skipped with the reason where mounting is not permitted). The second injects errors into a
journal through its seam, JournalKeeper's journal."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from auditor import audit
from grpc_health.v1 import health_pb2
from support.small_disk import small_tmpfs

from conftest import wait_until
from queue_client import QueueClient
from queue_client.format.batchfile import scan_queue
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.journal.file import Journal
from queue_server.journal.keeper import JournalKeeper, JournalUnwritable
from queue_server.journal.records import Consumed, Record
from queue_server.split.state import SplitState

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_NAME = "batchqueue.v1.BatchQueue/d"
CLIENT = "disk-full-test"
PAGE = 4096


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs under tmp_path, unmounted after the test's servers are gone."""
    with small_tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def _config() -> str:
    return textwrap.dedent(
        """
        [server]
        lease_ttl_s = 120
        [datasets.d]
        provider = "bq_test_providers:TinyProvider"
        batch_size = 2
        batches_per_file = 2
        max_backlog_files = 150
        """
    )


def _fill(ballast: int) -> None:
    """Write pages to the ballast file until the filesystem has none left."""
    while True:
        try:
            os.write(ballast, b"\xff" * PAGE)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return


def _acquire(server, wait_ms: int = 5_000) -> pb.Lease:
    return server.stub.AcquireLease(
        pb.AcquireLeaseRequest(dataset="d", split="train", client_id=CLIENT, wait_ms=wait_ms),
        timeout=30,
    )


def _release(server, lease: pb.Lease) -> None:
    server.stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=lease.lease_id, client_id=CLIENT, outcome=pb.CONSUMED),
        timeout=30,
    )


def test_a_full_disk_stops_the_split_reports_it_and_it_recovers(small_disk, start_server) -> None:
    root = small_disk / "data"
    server = start_server(_config(), data_root=root)
    server.wait_ready_files("d", 100)
    journal = root / "d" / "journal" / "train.jsonl"
    ballast = os.open(small_disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    consumed: list[int] = []
    held = None  # the lease whose release could not be journaled
    try:
        # Read on, keeping the disk full: each consumed record fills the journal's last page
        # until one needs a page the disk no longer has.
        for _ in range(400):
            _fill(ballast)
            try:
                lease = _acquire(server)
            except grpc.RpcError as err:  # production's own record failed first
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                break
            try:
                _release(server, lease)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                assert "nothing was changed" in err.details()
                held = lease
                break
            consumed.append(lease.seq)
            path = root / lease.path
            wait_until(lambda path=path: not path.exists(), 10, f"{path} deleted")
        else:
            pytest.fail(f"the journal never failed to grow; it has {journal.stat().st_size} bytes")
        stats = server.split_stats("d")
        assert "No space left on device" in stats["journal_error"]
        assert str(journal) in stats["journal_error"] and stats["disk_errors"] >= 1
        whole = server.stats("d")
        assert whole["state"] == "unavailable" and str(journal) in whole["last_error"]
        assert server.health(HEALTH_NAME) == NOT_SERVING and server.health() == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            _acquire(server, wait_ms=500)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "journal" in err.value.details() and "No space left" in err.value.details()
        assert "cannot append to the journal" in server.log()
        # Nothing consumed is lost, nothing more is made: the books balance on the full disk.
        audit(server, "d", consumed_seqs={"train": consumed})
    finally:
        os.close(ballast)
    (small_disk / "ballast").unlink()
    # The split probes with backoff and serves again by itself.
    wait_until(lambda: server.split_stats("d")["journal_error"] == "", 60, "the journal to recover")
    wait_until(lambda: server.health(HEALTH_NAME) == SERVING, 10, "SERVING again")
    assert server.stats("d")["last_error"] == ""
    if held is not None:  # the release that failed changed nothing: it is done again
        _release(server, held)
        consumed.append(held.seq)
    for _ in range(3):
        lease = _acquire(server)
        _release(server, lease)
        consumed.append(lease.seq)
    assert consumed == list(range(len(consumed)))
    audit(server, "d", consumed_seqs={"train": consumed})
    # A restart replays the journal: every consumed file counted once, the next one is next.
    server.kill()
    again = start_server(_config(), data_root=root)
    stats = audit(again, "d", consumed_seqs={"train": consumed})["train"]
    assert stats["seqs_consumed"] == len(consumed) and stats["seqs_missing"] == 0
    # The restarted server checks its inputs (a worker's start) before it leases: on a busy
    # machine that takes longer than a plain acquire's wait.
    assert _acquire(again, wait_ms=25_000).seq == len(consumed)


class FaultyJournal(Journal):
    """A journal whose appends fail with `fault` (an errno) while it is set: the seam."""

    fault = 0

    def append(self, record: Record) -> int:
        if self.fault:
            raise OSError(self.fault, os.strerror(self.fault))
        return super().append(record)


@pytest.mark.parametrize("code", [errno.EIO, errno.EPERM, errno.ENOSPC])
def test_injected_journal_errors_stop_report_and_recover(tmp_path: Path, code: int) -> None:
    """EIO, EPERM or ENOSPC on an append: the record is refused and changes nothing, the split
    reports the error with the path and errno text, and it recovers once appends succeed."""

    async def run() -> None:
        journal = FaultyJournal(tmp_path / f"{code}.jsonl")
        state = SplitState()
        reports: list[str | None] = []
        keeper = JournalKeeper(journal, "d/train", state, reports.append)
        keeper.append(Consumed(0, 1))
        journal.fault = code
        with pytest.raises(JournalUnwritable):
            keeper.append(Consumed(1, 1))
        text = f"[Errno {code}] {os.strerror(code)}"
        assert not keeper.healthy and text in state.journal_error
        assert str(journal.path) in state.journal_error and reports == [state.journal_error]
        assert state.counters.disk_errors == 1
        with pytest.raises(JournalUnwritable):  # still failing: reported once, counted again
            keeper.append(Consumed(1, 1))
        assert len(reports) == 1 and state.counters.disk_errors == 2
        journal.fault = 0
        # The probe writes beside the journal (which works here) and clears the state.
        for _ in range(200):
            if keeper.healthy:
                break
            await asyncio.sleep(0.02)  # the probe runs on this loop: let it
        assert keeper.healthy and reports[-1] is None
        keeper.append(Consumed(1, 1))
        await keeper.close()
        journal.close()
        assert Journal(journal.path).replay().consumed == {0, 1}

    asyncio.run(run())


# ---- consumed files whose releases could not be journaled ---------------------------------


def _acquire_seq(server, seq: int, wait_ms: int = 5_000) -> pb.Lease:
    """The lease of `seq` itself, as a trainer's stream names its next file."""
    return server.stub.AcquireLease(
        pb.AcquireLeaseRequest(
            dataset="d", split="train", client_id=CLIENT, seq=seq, wait_ms=wait_ms
        ),
        timeout=30,
    )


def _read_on_as_the_disk_fills(server, disk: Path, window: int = 4) -> tuple[list[int], list[int]]:
    """A trainer holding `window` leases reads on while the disk stays full, until the
    journal has no room for a release; then it reads the files it still holds, whose releases
    fail too. Returns (the seqs consumed and journaled, the seqs read whose releases failed)."""
    root = server.data_root
    ballast = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    held = [_acquire_seq(server, seq) for seq in range(window)]
    consumed: list[int] = []
    failed: list[int] = []
    try:
        for _ in range(400):
            _fill(ballast)
            lease = held.pop(0)
            try:
                _release(server, lease)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                failed.append(lease.seq)
                break
            consumed.append(lease.seq)
            path = root / lease.path
            wait_until(lambda path=path: not path.exists(), 10, f"{path} deleted")
            with contextlib.suppress(grpc.RpcError):  # the journal failed on a produced file
                held.append(_acquire_seq(server, held[-1].seq + 1 if held else lease.seq + 1))
        else:
            pytest.fail("the journal never failed to grow")
        # The files it still holds are read to their end too: their releases fail as well.
        for lease in held:
            _fill(ballast)
            with pytest.raises(grpc.RpcError) as err:
                _release(server, lease)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            failed.append(lease.seq)
    finally:
        os.close(ballast)
    assert server.split_stats("d")["journal_error"], "the journal should be failing"
    return consumed, failed


def _queue_files(root: Path) -> set[int]:
    return {name.seq for name in scan_queue(root / "d" / "queue" / "train")}


def test_releases_not_journaled_on_a_full_disk_are_journaled_once_it_has_room(
    small_disk, start_server
) -> None:
    """The server keeps a CONSUMED release it could not journal, and journals it (deleting
    the file) as soon as the journal can be written again: long before the lease's TTL."""
    root = small_disk / "data"
    server = start_server(_config(), data_root=root)
    server.wait_ready_files("d", 100)
    consumed, failed = _read_on_as_the_disk_fills(server, small_disk)
    assert failed and set(failed) <= _queue_files(root)  # still there: nothing was journaled
    (small_disk / "ballast").unlink()
    wait_until(lambda: server.split_stats("d")["journal_error"] == "", 60, "the journal to recover")
    wait_until(lambda: not set(failed) & _queue_files(root), 20, f"seqs {failed} deleted")
    # The trainer reads on from where it was; none of those files is served again.
    nxt = max(failed) + 1
    for seq in range(nxt, nxt + 3):
        lease = _acquire_seq(server, seq)
        _release(server, lease)
        consumed.append(seq)
    read = sorted(consumed + failed)
    assert read == list(range(len(read)))
    audit(server, "d", consumed_seqs={"train": read})
    server.kill()
    again = start_server(_config(), data_root=root)
    assert not set(failed) & _queue_files(root)
    audit(again, "d", consumed_seqs={"train": read})


def test_releases_lost_with_a_killed_server_on_a_full_disk_are_settled_by_the_trainer(
    small_disk, start_server
) -> None:
    """The server SIGKILLed while the releases could not be journaled, restarted once the
    disk has room: those files come back as ready, below where the trainer reads on. Once the
    trainer (a QueueClient resumed from its checkpoint) consumes its next file, the server
    knows the rank read past them: it journals them as consumed and deletes them. Each seq
    is read once, and nothing unread is lost."""
    root = small_disk / "data"
    server = start_server(_config(), data_root=root)
    server.wait_ready_files("d", 100)
    consumed, failed = _read_on_as_the_disk_fills(server, small_disk)
    server.kill()
    (small_disk / "ballast").unlink()
    again = start_server(_config(), data_root=root)
    assert set(failed) <= _queue_files(root)  # the journal says they were never consumed
    nxt = max(failed) + 1
    with QueueClient(again.address, "d", timeout_s=60) as trainer:
        state = trainer.state_dict()
        state["splits"]["train"] = {"seq": nxt, "offset": 0, "next_seq": nxt + 1, "pending": []}
        trainer.load_state_dict(state)
        for _ in range(3 * 2):  # three files of two batches
            trainer.get_batch("train")
        assert trainer.state_dict()["splits"]["train"]["seq"] == nxt + 3
    consumed += range(nxt, nxt + 3)
    wait_until(lambda: not set(failed) & _queue_files(root), 20, f"seqs {failed} deleted")
    assert f"seqs {', '.join(map(str, failed))} deleted as consumed" in again.log()
    read = sorted(consumed + failed)
    assert read == list(range(len(read))), read
    audit(again, "d", consumed_seqs={"train": read})
