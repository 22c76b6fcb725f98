"""The trainer chooses its batch size: get_batch(split, batch_size=B) takes the next B rows of
its stream, across file boundaries, and a checkpoint counts rows, so a batch-size ramp
resumes exactly, also at another world size. Rows are told apart by their content (random
ids: every row of these tiny files is distinct) against a reference read of the stream."""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from test_ordering_and_resume import Rank, _run

from queue_client import QueueClient
from queue_client.errors import InvalidRequest

BS, NB = 6, 2  # a file holds 12 rows: a ramp of 4 -> 8 -> 16 crosses files all the time
ROWS = BS * NB


def config(batch_size: int = BS, batches_per_file: int = NB, provider: str = "TinyProvider") -> str:
    return "[server]\nlease_ttl_s = 30\n" + textwrap.dedent(
        f"""
        [datasets.d]
        provider = "bq_test_providers:{provider}"
        batch_size = {batch_size}
        batches_per_file = {batches_per_file}
        max_backlog_files = 3
        """
    )


def rows_of(rank: Rank) -> list[tuple[int, ...]]:
    return [tuple(r) for b in rank.batches("d") for r in b["rows"]]


def reference(address: str, files: int) -> list[tuple[int, ...]]:
    """Rows 0.. of the one-rank stream (seqs 0, 1, 2, ... in order), read file batch by batch."""
    with QueueClient(address, "d", rank=0, world_size=1) as client:
        return [tuple(r) for _ in range(files * NB) for r in client.get_batch("train")[0].tolist()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from conftest import ServerFactory

    factory = ServerFactory(tmp_path_factory.mktemp("batch-size"))
    try:
        yield factory(config())
    finally:
        factory.close()


def test_a_ramp_resumed_mid_ramp_reads_every_row_once(server: Any, tmp_path: Path) -> None:
    address = server.address
    ref = reference(address, 12)
    assert len(set(ref)) == len(ref)  # every row recognisable
    # 4, 4, 4, 8, 8 rows (28: two files and 4 rows into the third), checkpoint, then a new
    # process resumes the ramp at 8 and doubles to 16.
    first = _run(
        tmp_path, "a", address, 1,
        lambda r: [{"dataset": "d", "sizes": [4, 4, 4, 8, 8], "state_out": str(tmp_path / "a")}],
    )  # fmt: skip
    state = json.loads((tmp_path / "a").read_text())
    assert state["splits"]["train"]["offset"] == 28 - 2 * ROWS  # rows, not batches
    second = _run(
        tmp_path, "b", address, 1,
        lambda r: [{"dataset": "d", "sizes": [8, 16, 16], "state_in": str(tmp_path / "a")}],
    )  # fmt: skip
    stitched = rows_of(first[0]) + rows_of(second[0])
    assert stitched == ref[: len(stitched)]
    # The same checkpoint resumed by two ranks: each goes on ramping; together they read
    # every row not yet read exactly once (the carried files, then their own strides).
    elastic = _run(
        tmp_path, "c", address, 2,
        lambda r: [{"dataset": "d", "sizes": [4, 8, 16, 16], "state_in": str(tmp_path / "a")}],
    )  # fmt: skip
    after = rows_of(elastic[0]) + rows_of(elastic[1])
    assert len(set(after)) == len(after), "a row was read twice"
    assert not set(after) & set(rows_of(first[0]))
    # Below the boundary (seq 4 = lcm(1, 2) rounding of next_seq 3 ... up to 4), every row
    # the one rank had left is read: rows 28 .. 4 * ROWS of the reference, and more.
    assert set(ref[28 : 4 * ROWS]) <= set(after)
    assert set(after) <= set(ref[28:])


def test_a_ramp_across_world_sizes_in_lockstep(server: Any, tmp_path: Path) -> None:
    """Two ranks ramp 4 -> 8 -> 16 in lockstep, checkpoint mid-ramp, and one rank resumes
    from both states: every row of the two streams is read once."""
    address = server.address
    two = _run(
        tmp_path, "two", address, 2,
        lambda r: [{"dataset": "d", "sizes": [4, 8, 8], "state_out": str(tmp_path / f"s{r}")}],
    )  # fmt: skip
    states = [json.loads((tmp_path / f"s{r}").read_text()) for r in range(2)]
    (tmp_path / "all").write_text(json.dumps(states))
    one = _run(
        tmp_path, "one", address, 1,
        lambda r: [{"dataset": "d", "sizes": [16, 16, 16, 16], "state_in": str(tmp_path / "all")}],
    )  # fmt: skip
    before = rows_of(two[0]) + rows_of(two[1])
    after = rows_of(one[0])
    assert len(set(before + after)) == len(before) + len(after), "a row was read twice"
    # Rank r's stream is seqs r, r + 2, ...: 20 rows each, so seqs 0..3 are read whole.
    with QueueClient(address, "d", rank=0, world_size=1) as client:
        whole = [tuple(r) for _ in range(4 * NB) for r in client.get_batch("train")[0].tolist()]
    assert set(whole) <= set(before + after)


def test_an_old_batch_granularity_state_still_loads(server: Any) -> None:
    ref = reference(server.address, 3)
    with QueueClient(server.address, "d", rank=0, world_size=1) as client:
        old = {
            "version": 2,
            "dataset": "d",
            "config_fingerprint": client.meta["config_fingerprint"],
            "rank": 0,
            "world_size": 1,
            "splits": {"train": {"seq": 1, "offset": 1, "next_seq": 2, "pending": []}},
        }
        client.load_state_dict(old)  # seq 1 from its second batch: row ROWS + BS
        got = [tuple(r) for r in client.get_batch("train", batch_size=10)[0].tolist()]
        assert got == ref[ROWS + BS : ROWS + BS + 10]
        assert client.state_dict()["splits"]["train"]["offset"] == 4  # rows into seq 2
        with pytest.raises(InvalidRequest, match=r"offset 3, but a file holds 2 batches"):
            client.load_state_dict(
                {**old, "splits": {"train": {**old["splits"]["train"], "offset": 3}}}
            )


def test_out_buffers_take_any_batch_size(server: Any) -> None:
    import torch

    ref = reference(server.address, 2)
    with QueueClient(server.address, "d", rank=0, world_size=1) as client:
        out = (torch.empty(10, 4, dtype=torch.int64), torch.empty(10, 4, dtype=torch.int64))
        x, y = client.get_batch("train", out, batch_size=10)
        assert x is out[0] and [tuple(r) for r in x.tolist()] == ref[:10]
        x, y = client.get_batch("train", out, batch_size=10)  # rows 10..20: crosses a file
        assert [tuple(r) for r in x.tolist()] == ref[10:20] and (y == x + 1).all()
        with pytest.raises(Exception, match=r"shape \(3, 4\)"):
            client.get_batch("train", out, batch_size=3)
        with pytest.raises(InvalidRequest, match="batch_size must be an int >= 1, got 0"):
            client.get_batch("train", batch_size=0)


def test_a_batch_size_past_a_batchs_memory_is_refused_and_numpy_sizes_serve(
    server: Any,
) -> None:
    """A batch's served fields may take MAX_BATCH_BYTES (16 GiB): 2**63, 10**9 and one row
    past the bound (x and y of 4 int64: 64 bytes a row) are refused naming batch_size and
    the bound, before torch is asked for the memory, and the stream serves on. numpy
    integers are sizes, in get_batch and in QueueDataset; numpy bools and floats are not."""
    import numpy as np
    from torch.utils.data import DataLoader

    from queue_client import QueueDataset
    from queue_client.streaming.rows import MAX_BATCH_BYTES

    ref = reference(server.address, 2)
    bound = MAX_BATCH_BYTES // 64
    with QueueClient(server.address, "d", rank=0, world_size=1) as client:
        for size in (2**63, 10**9, bound + 1):
            with pytest.raises(
                InvalidRequest,
                match=rf"^batch_size={size} is more rows than one batch of d/train may hold: "
                rf"at most {bound} \(16 GiB of served fields at 64 bytes a row\)$",
            ):
                client.get_batch("train", batch_size=size)
        x, _ = client.get_batch("train", batch_size=np.int64(3))
        assert [tuple(r) for r in x.tolist()] == ref[:3]
        x, _ = client.get_batch("train", batch_size=np.uint8(10))  # crosses into seq 1
        assert [tuple(r) for r in x.tolist()] == ref[3:13]
        for bad in (np.True_, np.float32(3), 3.0):
            with pytest.raises(
                InvalidRequest, match=re.escape(f"batch_size must be an int >= 1, got {bad!r}")
            ):
                client.get_batch("train", batch_size=bad)  # type: ignore[arg-type]
    with QueueDataset(
        server.address, "d", "train", rank=0, world_size=1, batch_size=np.int32(5), max_batches=2
    ) as ds:
        assert ds.batch_size == 5 and type(ds.batch_size) is int
        got = [tuple(r) for x, _ in DataLoader(ds, batch_size=None) for r in x.tolist()]
    assert got == ref[:10]


def test_a_grad_accumulation_layout_refuses_another_batch_size(
    start_server, tmp_path: Path
) -> None:
    """[A, B, T] batches are one optimizer step each: another size is refused, naming why,
    and a changed batch_size in the config still changes the files (refused until reset)."""
    from test_safe_rebuilds import serve_once

    root = tmp_path / "root"
    server = start_server(config(batch_size=3, provider="GradAccumProvider"), data_root=root)
    with QueueClient(server.address, "d") as client:
        x, _ = client.get_batch("train")
        assert tuple(x.shape) == (3, 2, 4)
        with pytest.raises(InvalidRequest, match=r"not batch_size=2: .*grad_accum = 3"):
            client.get_batch("train", batch_size=2)
        assert tuple(client.get_batch("train", batch_size=3)[0].shape) == (3, 2, 4)
    server.stop()
    changed = tmp_path / "changed.toml"
    changed.write_text(config(batch_size=2, provider="GradAccumProvider"))
    proc = serve_once(changed, root)
    assert proc.returncode == 2 and "queue-server reset d" in proc.stderr, proc.stderr


def test_a_changed_batch_size_keeps_the_files(start_server, tmp_path: Path) -> None:
    """batch_size 6 -> 4 on the same data root: no rebuild, the files keep their 6-row unit,
    the default batch is 4 rows, and a checkpoint of the first run resumes the same rows.
    batches_per_file still changes the files: that config is refused, naming reset."""
    from test_safe_rebuilds import serve_once

    root = tmp_path / "root"
    first = start_server(config(), data_root=root)
    ref = reference(first.address, 3)
    with QueueClient(first.address, "d") as client:
        client.get_batch("train", batch_size=5)
        state = client.state_dict()
    first.stop()
    second = start_server(config(batch_size=4), data_root=root)
    with QueueClient(second.address, "d") as client:
        assert (client.batch_size, client.file_batch_size) == (4, BS)
        client.load_state_dict(state)
        x, _ = client.get_batch("train")
        assert [tuple(r) for r in x.tolist()] == ref[5:9]
    second.stop()
    changed = tmp_path / "changed.toml"
    changed.write_text(config(batch_size=4, batches_per_file=3))
    proc = serve_once(changed, root)
    assert proc.returncode == 2 and "queue-server reset d" in proc.stderr, proc.stderr


def test_a_queue_dataset_takes_a_batch_size(server: Any) -> None:
    from torch.utils.data import DataLoader

    from queue_client import QueueDataset

    ref = reference(server.address, 2)
    with QueueDataset(
        server.address, "d", "train", rank=0, world_size=1, batch_size=8, max_batches=3
    ) as ds:
        got = [tuple(r) for x, _ in DataLoader(ds, batch_size=None) for r in x.tolist()]
    assert got == ref[:24]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1 or None, got 0"):
        QueueDataset(server.address, "d", batch_size=0)


def test_a_batch_of_more_files_than_a_rank_may_hold_is_served(start_server) -> None:
    """100 rows span 9 files of 12, more than the 4 a rank may hold at once (max_backlog_files
    2 + 2): each file is released once its rows are copied, so the batch never waits on
    itself. Zero-copy views, copies and out= buffers (a dataset each, so that every file is
    made fresh, inside the rank's window) all read the stream's rows in order."""
    import torch

    table = (
        config()
        .split("\n[datasets.d]")[1]
        .replace("max_backlog_files = 3", "max_backlog_files = 2")
    )
    server = start_server("".join(f"\n[datasets.{name}]{table}" for name in "dce"))
    got: dict[str, list[tuple[int, ...]]] = {"d": [], "c": [], "e": []}
    for name, kwargs in (("d", {}), ("c", {"copy": True})):
        with QueueClient(server.address, name, **kwargs) as client:
            for _ in range(2):
                got[name] += [tuple(r) for r in client.get_batch("train", batch_size=100)[0].tolist()]  # fmt: skip
    with QueueClient(server.address, "e") as client:
        out = (torch.empty(100, 4, dtype=torch.int64), torch.empty(100, 4, dtype=torch.int64))
        for _ in range(2):
            x, y = client.get_batch("train", out, batch_size=100)
            assert (y == x + 1).all()
            got["e"] += [tuple(r) for r in x.tolist()]
    for name, rows in got.items():  # the same stream read again, file batch by file batch
        with QueueClient(server.address, name) as client:
            ref = [tuple(r) for _ in range(17 * NB) for r in client.get_batch("train")[0].tolist()]
        assert rows == ref[:200], name


@pytest.mark.cold_forkserver  # stops the server's production processes, its descendants
def test_a_batch_that_fails_mid_way_is_served_whole_on_the_next_call(
    start_server, tmp_path: Path
) -> None:
    """The provider stops (SIGSTOP) after a few files: a 100-row batch reads them, releases
    them, then times out waiting for the next. Once production goes on, the same call
    serves the same 100 rows from the first: the files it had let go are asked for again
    and made again, as on a resume, and the next batch follows on."""
    import os
    import signal

    from conftest import process_tree, wait_until
    from queue_client.errors import NoBatchReady

    server = start_server(config().replace("max_backlog_files = 3", "max_backlog_files = 2"))
    server.wait_ready_files("d", 3)
    production = process_tree(server.pid) - {server.pid}
    for pid in production:
        os.kill(pid, signal.SIGSTOP)
    try:
        # 6 s: long enough to read the ready files on a loaded machine; the file after them
        # never comes while production is stopped.
        with QueueClient(server.address, "d", rank=0, world_size=1, timeout_s=6.0) as client:
            with pytest.raises(NoBatchReady):
                client.get_batch("train", batch_size=100)
            wait_until(  # files were let go (their releases run in the client's background)
                lambda: server.split_stats("d")["consumed_files"] >= 1, 60, "a file released"
            )
            for pid in production:
                os.kill(pid, signal.SIGCONT)
            production = set()
            got = []
            deadline = time.monotonic() + 120  # a retry that times out again rewinds again
            while len(got) < 200:
                try:
                    x, _ = client.get_batch("train", batch_size=100)
                except NoBatchReady:
                    assert time.monotonic() < deadline, "production did not go on"
                    continue
                got += [tuple(r) for r in x.tolist()]
    finally:
        for pid in production:
            os.kill(pid, signal.SIGCONT)
    assert got == reference(server.address, 17)[:200]
