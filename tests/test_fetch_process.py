"""QueueClient(fetch_process=True): a helper process leases, verifies and copies each file
into a ring of shared memory; the trainer's stream reads rows from the ring. Real servers,
real helper processes, real trainer processes for the crash cases. Rows are told apart by
their content (TinyProvider's rows are distinct) against a read by a client of its own."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from test_batch_size import NB, ROWS, config, reference, rows_of
from test_ordering_and_resume import Rank, _run, tiny_tables

from conftest import ServerFactory, process_gone, process_tree
from queue_client import QueueClient
from queue_client.errors import InvalidRequest, ServerUnavailable
from queue_server.testing import wait_until

TOKEN = "fetch-helper-s3cret"


# Leases outlive every wait below: a file counted back was given back, not expired.
LONG_TTL = config().replace("lease_ttl_s = 30", "lease_ttl_s = 600") + tiny_tables(
    "be", mode="best_effort"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    assert "lease_ttl_s = 600" in LONG_TTL
    factory = ServerFactory(tmp_path_factory.mktemp("fetch-process"))
    try:
        yield factory(LONG_TTL)
    finally:
        factory.close()


def _rows(client: QueueClient, sizes: list[int]) -> list[tuple[int, ...]]:
    return [tuple(r) for s in sizes for r in client.get_batch("train", batch_size=s)[0].tolist()]


def _leased(server: Any) -> int:
    return int(server.split_stats("d")["leased_files"])


@pytest.mark.parametrize("transport", ["file", "grpc"])
def test_the_helper_serves_the_rows_the_client_itself_serves(server: Any, transport: str) -> None:
    ref = reference(server.address, 10)
    sizes = [4, 4, 4, 8, 8, 16, 16, 16, 5, 7, 20]  # crossing files, and whole ones
    with QueueClient(
        server.address, "d", rank=0, world_size=1, fetch_process=True, transport=transport
    ) as client:
        assert client.transport == transport
        got = _rows(client, sizes)
        helper = client._helper
        assert helper is not None and helper.proc.poll() is None
    assert got == ref[: len(got)]
    assert helper.proc.poll() is not None, "the helper outlived its client's close"


def test_a_ramp_resumed_mid_ramp_through_the_helper_reads_every_row_once(
    server: Any, tmp_path: Path
) -> None:
    ref = reference(server.address, 12)
    first = _run(
        tmp_path, "a", server.address, 1,
        lambda r: [{"dataset": "d", "sizes": [4, 4, 4, 8, 8], "state_out": str(tmp_path / "a")}],
        fetch_process=True,
    )  # fmt: skip
    state = json.loads((tmp_path / "a").read_text())
    assert state["splits"]["train"]["offset"] == 28 - 2 * ROWS
    second = _run(
        tmp_path, "b", server.address, 1,
        lambda r: [{"dataset": "d", "sizes": [8, 16, 16], "state_in": str(tmp_path / "a")}],
        fetch_process=True,
    )  # fmt: skip
    stitched = rows_of(first[0]) + rows_of(second[0])
    assert stitched == ref[: len(stitched)]


def test_close_gives_back_every_file_the_helper_held(server: Any) -> None:
    with QueueClient(
        server.address, "d", rank=0, world_size=1, fetch_process=True, prefetch_files=3
    ) as client:
        client.get_batch("train")
        # Files read ahead are leased by the helper meanwhile.
        wait_until(lambda: _leased(server) >= 2, 60, "the helper's read-ahead leases")
    assert _leased(server) == 0


def test_a_batch_outlives_the_slot_its_rows_came_from(server: Any) -> None:
    ref = reference(server.address, 12)
    with QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True) as client:
        x, _ = client.get_batch("train")
        kept = x.clone()
        rest = _rows(client, [ROWS] * 10)  # every slot of the ring refilled since
        assert x.data_ptr() != 0 and bool((x == kept).all()), "a batch changed under the trainer"
    assert [tuple(r) for r in kept.tolist()] + rest == ref[: ROWS // NB + len(rest)]


def test_a_dead_helper_is_named_by_the_next_switch_that_needs_it(server: Any) -> None:
    with QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True) as client:
        client.get_batch("train")
        helper = client._helper
        assert helper is not None
        helper.proc.send_signal(signal.SIGKILL)
        helper.proc.wait(timeout=30)
        with pytest.raises(ServerUnavailable, match=r"fetch helper \(pid \d+, exited with -9\)"):
            for _ in range(100 * NB):  # the files it had put in the ring are served first
                client.get_batch("train")


def test_a_killed_trainer_takes_its_helper_with_it_and_its_files_go_back(
    server: Any, tmp_path: Path
) -> None:
    rank = Rank(
        tmp_path, "held", server.address, 0, 1,
        [{"dataset": "d", "batches": 3}], hold=True, fetch_process=True,
    )  # fmt: skip
    rank.wait_ready()
    tree = process_tree(rank.proc.pid) - {rank.proc.pid}
    assert tree, "no helper process under the trainer"
    wait_until(lambda: _leased(server) >= 1, 60, "the trainer's files leased")
    rank.kill()
    # The helper sees its link close, gives back the files it holds, and exits.
    wait_until(lambda: all(process_gone(p) for p in tree), 60, "the helper to exit")
    wait_until(lambda: _leased(server) == 0, 60, "the helper's files given back")


def test_ctrl_c_is_the_trainers_to_handle_not_the_helpers(server: Any) -> None:
    """Ctrl-C reaches a terminal's whole process group; the helper ignores it and serves on
    until its trainer closes the link (or dies)."""
    ref = reference(server.address, 8)
    with QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True) as client:
        first = _rows(client, [ROWS])
        helper = client._helper
        assert helper is not None
        os.kill(helper.proc.pid, signal.SIGINT)
        rest = _rows(client, [ROWS] * 6)  # switches that need the helper, after the signal
        assert helper.proc.poll() is None
    assert first + rest == ref[: len(first) + len(rest)]
    assert helper.proc.returncode == 0


def test_a_best_effort_stream_through_the_helper_reads_rows_once(server: Any) -> None:
    with QueueClient(server.address, "be", rank=0, world_size=1, fetch_process=True) as client:
        rows = [tuple(r) for _ in range(40) for r in client.get_batch("train")[0].tolist()]
        assert client.stream_view("train").seq is not None
    assert len(set(rows)) == len(rows), "a row was served twice"
    wait_until(lambda: int(server.split_stats("be")["leased_files"]) == 0, 60, "be's leases back")


def test_the_helper_process_loads_no_torch(server: Any) -> None:
    """torch would be most of the helper's memory and start: it moves bytes with numpy."""
    with QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True) as client:
        client.get_batch("train")
        helper = client._helper
        assert helper is not None
        maps = Path(f"/proc/{helper.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the fetch helper loaded torch"
        assert "libtorch" in Path(f"/proc/{os.getpid()}/maps").read_text()  # the check sees it


def test_fetch_process_needs_prefetch(server: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"fetch_process=True .* needs prefetch=True"):
        QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True, prefetch=False)


def test_the_token_reaches_the_helper_by_its_environment_only(tmp_path: Path) -> None:
    factory = ServerFactory(tmp_path)
    try:
        server = factory(config().replace("[server]\n", f'[server]\nauth_token = "{TOKEN}"\n'))
        with QueueClient(
            server.address, "d", rank=0, world_size=1, fetch_process=True, auth_token=TOKEN
        ) as client:
            client.get_batch("train")
            helper = client._helper
            assert helper is not None
            cmdline = Path(f"/proc/{helper.proc.pid}/cmdline").read_bytes()
            assert TOKEN.encode() not in cmdline
            environ = Path(f"/proc/{helper.proc.pid}/environ").read_bytes()
            assert f"BATCHQUEUE_TOKEN={TOKEN}".encode() in environ.split(b"\0")
        assert os.environ.get("BATCHQUEUE_TOKEN") != TOKEN  # the trainer's own is unchanged
    finally:
        factory.close()


def test_a_helper_that_cannot_reach_the_server_is_named_at_the_first_batch(tmp_path: Path) -> None:
    factory = ServerFactory(tmp_path)
    try:
        server = factory(config())
        client = QueueClient(
            server.address, "d", rank=0, world_size=1, fetch_process=True, reconnect_timeout_s=1
        )
        server.stop()
        with pytest.raises(ServerUnavailable, match=r"the fetch helper could not start: "):
            client.get_batch("train")
        client.close()
    finally:
        factory.close()


def test_a_resume_in_the_same_client_reuses_the_helper_and_reads_on_exactly(server: Any) -> None:
    ref = reference(server.address, 8)
    with QueueClient(server.address, "d", rank=0, world_size=1, fetch_process=True) as client:
        first = _rows(client, [5, 5, 5])
        state = client.state_dict()
        _rows(client, [ROWS] * 2)  # read past the checkpoint, then go back to it
        helper = client._helper
        client.load_state_dict(state)
        again = _rows(client, [ROWS] * 3)
        assert client._helper is helper and helper is not None and helper.proc.poll() is None
    assert first + again == ref[: len(first) + len(again)]


def test_an_old_root_of_format_1_files_is_served_through_the_helper(
    start_server: Any, corpus: Path, tmp_path: Path
) -> None:
    """Files of format 1 (torch's own, from a root built before format 2) are read by the
    helper with torch after all; the batches are those of a fresh root."""
    from test_compact_storage import _read, _same, format_1_root

    from conftest import char_config

    config = char_config(corpus, batches_per_file=4)
    fresh = start_server(config, data_root=tmp_path / "fresh")
    with QueueClient(fresh.address, "chars", fetch_process=True) as client:
        new_batches = _read(client, "train", 10)
    fresh.stop()
    format_1_root(tmp_path / "fresh", tmp_path / "old", "chars")
    old = start_server(config, data_root=tmp_path / "old")
    with QueueClient(old.address, "chars", fetch_process=True) as client:
        old_batches = _read(client, "train", 10)
        helper = client._helper
        assert helper is not None
        assert "libtorch" in Path(f"/proc/{helper.proc.pid}/maps").read_text()
    assert _same(new_batches, old_batches)


def test_a_helper_looking_in_the_wrong_data_root_is_named_and_quarantines_nothing(
    server: Any, tmp_path: Path
) -> None:
    """transport="file" with a data_root that is not the server's: the helper finds no file,
    and that is the client's mistake, not a corrupt file (nothing is quarantined)."""
    before = int(server.split_stats("d")["quarantined_files"])
    with QueueClient(
        server.address, "d", rank=0, world_size=1, fetch_process=True, transport="file",
        data_root=tmp_path, timeout_s=30,
    ) as client:  # fmt: skip
        with pytest.raises(InvalidRequest, match=r"is not visible here: data_root .* does not"):
            client.get_batch("train")
    assert int(server.split_stats("d")["quarantined_files"]) == before
    wait_until(lambda: _leased(server) == 0, 60, "the file given back")
