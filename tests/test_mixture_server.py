"""Data mixtures through real servers and clients: exact proportions at every prefix, the
`source` field true to each row, a weight change every rank sees at the same row, a SIGKILL
and an elastic resume (4 ranks -> 2) after which every source continues its own stream with
nothing lost or repeated, node-local servers, stats, and the errors a caller can cause.

Each source is a nanogpt_bin corpus written here over its own token range (source i holds
ids i*100 .. i*100+99), so a row's tokens name its true source. The reference a run is held
against is built independently of the server: the pure row schedule (queue_client.mixture)
and each source provider's own files, made in this process.
"""

from __future__ import annotations

import json
import math
import signal
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.mixture_reads import read_positioned

from conftest import ServerFactory, wait_until
from queue_client import InvalidRequest, QueueClient
from queue_client.cli import main as cli_main
from queue_client.mixture import RowSchedule, WeightPlan
from queue_client.wire import batchqueue_pb2 as pb
from queue_providers.base import ProviderContext
from queue_providers.mixture.sources import SourceRows, build_sources, source_meta
from queue_server.testing import ServerProcess

B, NB = 4, 5  # batch size, batches per file
R = B * NB  # rows per file
BLOCK = 8
NAMES = ("web", "code", "math")
WEIGHTS = (0.5, 0.3, 0.2)


def write_sources(tmp: Path) -> dict[str, Path]:
    dirs = {}
    for i, name in enumerate(NAMES):
        d = tmp / "sources" / name
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        for split in ("train", "val"):
            ids = rng.integers(i * 100, i * 100 + 100, size=4000).astype(np.uint16)
            ids.tofile(d / f"{split}.bin")
        dirs[name] = d
    return dirs


def mixture(name: str, dirs: dict[str, Path], extra: str = "") -> str:
    text = f"[datasets.{name}]\nbatch_size = {B}\nbatches_per_file = {NB}\n{extra}\n"
    for source, weight in zip(NAMES, WEIGHTS, strict=True):
        text += textwrap.dedent(
            f"""
            [datasets.{name}.sources.{source}]
            provider = "nanogpt_bin"
            weight = {weight}
            [datasets.{name}.sources.{source}.args]
            data_dir = "{dirs[source].as_posix()}"
            block_size = {BLOCK}
            vocab_size = 300
            """
        )
    return text


class Reference:
    """Each source's own stream, made in this process by the source providers themselves."""

    def __init__(self, dirs: dict[str, Path], tmp: Path, dataset: str) -> None:
        context = ProviderContext(dataset, tmp / "ref" / dataset, B, NB, seed=1337)
        specs = [
            {"name": n, "provider": "nanogpt_bin", "weight": w,
             "args": {"data_dir": str(dirs[n]), "block_size": BLOCK, "vocab_size": 300}}
            for n, w in zip(NAMES, WEIGHTS, strict=True)
        ]  # fmt: skip
        self.providers = build_sources(context, specs)
        for p in self.providers:
            p.set_meta(source_meta(p, context))
        self.rows = [SourceRows(p) for p in self.providers]
        self._made: dict[int, torch.Tensor] = {}

    def stream(self, source: int, n: int) -> torch.Tensor:
        """Rows [0, n) of a source's own stream (x)."""
        made = self._made.get(source, torch.empty(0, BLOCK, dtype=torch.int64))
        if len(made) < n:
            more = self.rows[source].rows("train", len(made), max(n, 2 * len(made)), R)["x"]
            made = self._made[source] = torch.cat([made, more])
        return made[:n]


def plan() -> WeightPlan:
    return WeightPlan(NAMES, WEIGHTS, (), R)


def schedule(
    changes: list[tuple[int, dict[str, float] | None]], p: WeightPlan | None = None
) -> RowSchedule:
    p = p or plan()
    return RowSchedule(p.segments(p.by_name(changes)))


def read(client: QueueClient, n: int) -> list[dict[str, Any]]:
    return read_positioned(client, n, "x")


def check_rows(batches: list[dict[str, Any]], sched: RowSchedule, ref: Reference) -> dict:
    """Every row is the schedule's source at its global row, and that source's own row at
    the source's count there; returns {global row: source} of what was checked."""
    seen: dict[int, int] = {}
    for b in batches:
        first = b["seq"] * R + b["offset"]  # the state counts rows into the file
        expected = sched.sources_of(first, first + B)
        assert b["source"].tolist() == expected, (b["seq"], b["offset"])
        counts = sched.counts(first)
        for i, s in enumerate(expected):
            assert int(b["x"][i].min()) // 100 == s  # the field names the row's true source
            assert torch.equal(b["x"][i], ref.stream(s, counts[s] + 1)[counts[s]])
            counts[s] += 1
            assert first + i not in seen, f"row {first + i} served twice"
            seen[first + i] = s
    return seen


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("mixture")
    dirs = write_sources(tmp)
    config = mixture("mix", dirs) + mixture("ranks", dirs)
    config += mixture("sched", dirs, "mixture_schedule = [[1000, { math = 1.0 }]]")
    config += mixture("raw", dirs)
    factory = ServerFactory(tmp)
    yield factory(config), tmp
    factory.close()


@pytest.fixture(scope="module")
def reference(shared) -> Reference:
    _, tmp = shared
    # The files `shared` wrote, read as they are: writing them again would truncate them
    # under the running server, whose workers then find no tokens and fail the dataset.
    return Reference({name: tmp / "sources" / name for name in NAMES}, tmp, "mix")


def test_counts_stay_within_one_row_of_the_weights_at_every_prefix(shared, reference) -> None:
    """10,000 rows of 0.5/0.3/0.2: at every prefix each source's count is within one row of
    its weight times the rows so far, and each row is its source's next own row."""
    server, _ = shared
    with QueueClient(server.address, "mix") as client:
        assert client.meta["mixture"]["sources"] == list(NAMES)
        batches = read(client, 10_000 // B)
    seen = check_rows(batches, schedule([]), reference)
    assert sorted(seen) == list(range(10_000))
    counts = [0, 0, 0]
    for n in range(10_000):
        counts[seen[n]] += 1
        for s, w in enumerate(WEIGHTS):
            assert abs(counts[s] - w * (n + 1)) < 1, (n, counts)
    assert counts == [5000, 3000, 2000]


def test_a_weight_change_lands_on_the_same_row_for_every_rank(shared, reference, capsys) -> None:
    """4 ranks step in lockstep; each calls set_mixture at step 7: all get the same seq, and
    every rank's rows follow the new weights from exactly that file on."""
    server, _ = shared
    clients = [QueueClient(server.address, "ranks", rank=r, world_size=4) for r in range(4)]
    try:
        batches: list[list[dict]] = [[] for _ in range(4)]
        ats = []
        for step in range(45):
            for r, c in enumerate(clients):
                batches[r] += read(c, 1)
                if step == 7:
                    ats.append(c.set_mixture({"web": 0.1, "code": 0.1, "math": 0.8}))
        stats = clients[0].stats()["splits"]
    finally:
        for c in clients:
            c.close()
    assert len(set(ats)) == 1 and ats[0] % 4 == 0, ats
    at = ats[0]
    # Past the last file any rank could have had made at the call, and reached within the run.
    assert 4 * (7 // NB + 1) <= at <= 4 * (44 // NB), at
    sched = schedule([(at, {"web": 0.1, "code": 0.1, "math": 0.8})] * 4)
    for rank in batches:
        check_rows(rank, sched, reference)
    # The rows of the new weights: within one row of 0.1/0.1/0.8 from the change on.
    after = [s for rank in batches for b in rank if b["seq"] >= at for s in b["source"].tolist()]
    assert after and abs(after.count(2) / len(after) - 0.8) < 0.05
    mix = next(s for s in stats if s["split"] == "train")["mixture"]
    assert [h["origin"] for h in mix["history"]] == ["config"] + ["SetMixture"] * 4
    assert {int(h["effective_seq"]) for h in mix["history"][1:]} == {at}
    assert cli_main(["stats", "--address", server.address, "ranks"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines may wrap at the terminal's width
    assert "weight history (4 change(s) after the config's):" in out, out
    assert f"from seq {at} (SetMixture): web 0.1, code 0.1, math 0.8" in out, out


def test_sigkill_and_resume_at_another_world_size_continue_every_source(
    start_server, tmp_path: Path
) -> None:
    """4 ranks read, reweight, checkpoint mid-file, read on (lost work); the server is
    SIGKILLed; 2 ranks resume from the 4 states on a restarted server and reweight again.
    Every source's rows over the whole run are exactly its own stream's prefix."""
    dirs = write_sources(tmp_path)
    config = mixture("mix", dirs)
    root = tmp_path / "root"
    server = start_server(config, data_root=root)
    ref = Reference(dirs, tmp_path, "mix")
    clients = [QueueClient(server.address, "mix", rank=r, world_size=4) for r in range(4)]
    kept: list[dict] = []
    changes: list[tuple[int, dict[str, float] | None]] = []
    for step in range(14):
        for c in clients:
            kept += read(c, 1)
            if step == 2:
                changes.append((c.set_mixture({"web": 0.2, "code": 0.7, "math": 0.1}), None))
    states = [c.state_dict() for c in clients]  # the checkpoint: mid-file
    for c in clients:
        read(c, 6)  # served, never checkpointed: served again after the resume
        c.close()
    server.kill(signal.SIGKILL)
    server = start_server(config, data_root=root)
    resumed = [QueueClient(server.address, "mix", rank=r, world_size=2) for r in range(2)]
    try:
        for c in resumed:
            c.load_state_dict(states)
        for step in range(45):
            for c in resumed:
                kept += read(c, 1)
                if step == 5:
                    changes.append((c.set_mixture({"web": 1, "code": 1, "math": 1}), None))
        stats = resumed[0].stats()["splits"]
    finally:
        for c in resumed:
            c.close()
    weights = [{"web": 0.2, "code": 0.7, "math": 0.1}] * 4 + [{"web": 1, "code": 1, "math": 1}] * 2
    sched = schedule([(at, w) for (at, _), w in zip(changes, weights, strict=True)])
    seen = check_rows(kept, sched, ref)
    # The rows served are a prefix of the split's rows, up to the files still being read.
    end = max(seen) + 1
    missing = sorted(set(range(end)) - set(seen))
    assert not missing or missing[0] >= end - 2 * R, missing[:5]
    # So each source's rows are its stream's prefix: rows 0..c_s-1, no gap, no repeat.
    prefix = min(missing) if missing else end
    counts = sched.counts(prefix)
    for s in range(3):
        got = sorted(n for n, src in seen.items() if src == s and n < prefix)
        assert len(got) == counts[s]
    mix = next(s for s in stats if s["split"] == "train")["mixture"]
    assert len(mix["history"]) == 1 + 6  # the calls of both runs, from the journal


def test_node_local_servers_make_the_same_rows(shared, reference, tmp_path: Path) -> None:
    """Two servers of a world of 4 (ranks 0-1 and 2-3): each rank's rows are those the
    single server gives, reweighting included (one call per server)."""
    _, tmp = shared
    dirs = {name: tmp / "sources" / name for name in NAMES}  # as written (not again: see above)
    factory = ServerFactory(tmp_path)
    try:
        a = factory(
            mixture("mix", dirs),
            data_root=tmp_path / "a",
            args=("--ranks", "0,1", "--world-size", "4"),
        )
        b = factory(
            mixture("mix", dirs),
            data_root=tmp_path / "b",
            args=("--ranks", "2,3", "--world-size", "4"),
        )
        addresses = [a.address, a.address, b.address, b.address]
        clients = [QueueClient(addresses[r], "mix", rank=r, world_size=4) for r in range(4)]
        batches: list[dict] = []
        ats = []
        for step in range(16):
            for r, c in enumerate(clients):
                batches += read(c, 1)
                if step == 3 and r in (0, 2):
                    ats.append(c.set_mixture({"web": 0.0, "code": 1.0}))
        for c in clients:
            c.close()
    finally:
        factory.close()
    assert ats[0] == ats[1], ats
    check_rows(batches, schedule([(ats[0], {"web": 0.0, "code": 1.0})] * 2), reference)


def test_a_config_schedule_point_switches_weights_at_its_file(shared, reference) -> None:
    """A point at 1,000 tokens: files of 20 rows x 8 tokens, so from seq 7 on (the first file
    starting at or past it) only math; each source still continues its own stream."""
    server, _ = shared
    with QueueClient(server.address, "sched") as client:
        batches = read(client, 12 * NB)
    p = WeightPlan(NAMES, WEIGHTS, ((1000, (0.0, 0.0, 1.0)),), R, BLOCK)
    assert p.point_seqs() == [7]
    check_rows(batches, schedule([], p), reference)
    # The deficits the first weights left are paid first: then only math.
    assert {int(s) for b in batches[8 * NB :] for s in b["source"]} == {2}


def test_a_call_without_a_position_starts_past_every_file_made(shared, reference) -> None:
    """grpcurl's way: no position_seq. The change starts at the first seq no worker made or
    is making, and the rows follow it from there."""
    server, _ = shared
    with QueueClient(server.address, "raw") as client:
        before = read(client, NB)  # file 0 read: the server has made some files ahead
        made = int(server.split_stats("raw")["produced_files"])
        reply = server.stub.SetMixture(
            pb.SetMixtureRequest(dataset="raw", weights={"code": 1.0}), timeout=30
        )
        at = int(reply.effective_seq)
        assert made <= at <= 1 + 2 + 2  # past what was made; within the backlog window
        after = read(client, (at + 2) * NB)
    check_rows(before + after, schedule([(at, {"code": 1.0})]), reference)
    reset = server.stub.SetMixture(pb.SetMixtureRequest(dataset="raw", reset=True), timeout=30)
    assert int(reset.effective_seq) >= at


def test_set_mixture_errors_name_what_is_wrong(shared) -> None:
    server, _ = shared
    with QueueClient(server.address, "mix") as client:
        with pytest.raises(InvalidRequest, match=r"unknown source\(s\) \['books'\].*web"):
            client.set_mixture({"web": 1.0, "books": 1.0})
        with pytest.raises(InvalidRequest, match=r"'code': -1\.0.*>= 0"):
            client.set_mixture({"web": 1.0, "code": -1.0})
        with pytest.raises(InvalidRequest, match=r"'web': nan"):
            client.set_mixture({"web": math.nan})
        with pytest.raises(InvalidRequest, match="all zero"):
            client.set_mixture({"web": 0.0, "code": 0})
        with pytest.raises(InvalidRequest, match="not a number"):
            client.set_mixture({"web": "much"})  # type: ignore[dict-item]
        with pytest.raises(
            InvalidRequest, match="a source name in weights is 100 characters long; at most 64"
        ):
            client.set_mixture({"web": 1.0, "x" * 100: 1.0})


def test_stats_and_metrics_show_each_source(shared, capsys) -> None:
    server, _ = shared
    with QueueClient(server.address, "mix") as client:
        for _ in range(NB + 1):  # the first file is consumed, whatever ran before
            client.get_batch("train")
        wait_until(lambda: int(server.split_stats("mix")["consumed_files"]) >= 1, timeout_s=60)
        stats = next(s for s in client.stats()["splits"] if s["split"] == "train")
    mix = stats["mixture"]
    rows = int(mix["rows_served"])
    assert rows > 0 and rows % R == 0
    by_name = {s["name"]: s for s in mix["sources"]}
    assert list(by_name) == list(NAMES)
    for name, w in zip(NAMES, WEIGHTS, strict=True):
        s = by_name[name]
        assert abs(float(s["share"]) - w) < 1 / rows + 1e-9
        assert float(s["target_share"]) == pytest.approx(w)
        assert float(s["weight"]) == pytest.approx(w)
        assert int(s["tokens_served"]) == int(s["rows_served"]) * BLOCK
        assert float(s["epochs"]) == pytest.approx(int(s["tokens_served"]) / 4000)
    assert sum(int(s["rows_served"]) for s in mix["sources"]) == rows
    assert cli_main(["stats", "--address", server.address, "mix"]) == 0
    out = capsys.readouterr().out
    assert "mixture over" in out and "web: weight 0.500" in out
    assert cli_main(["stats", "--address", server.address, "--json", "mix"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "mixture" in json.dumps(doc)
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'batchqueue_mixture_share{dataset="mix",source="web",split="train"}' in metrics
    assert 'batchqueue_mixture_rows_total{dataset="mix",source="math",split="train"}' in metrics
