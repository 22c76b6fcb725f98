"""A server per node: each makes only its own ranks' files, every rank's stream is the one a
single server gives, and a checkpoint resumes on another set of servers, fresh disks included.

Real server and trainer processes throughout. One stateless provider (char_lm) and one
streaming provider (text_lm, byte tokenizer, two workers) are served side by side; a batch is
identified by its position (seq, offset) and a hash of its bytes (tests/support/rank_client.py).

The run, once for the module (the tests below look at it from different sides):
1. reference: one server, four ranks, 20 batches each (seqs 0-19 of both datasets);
2. nodes: server A for ranks 0-1 (--ranks) and B for ranks 2-3 (torchrun's environment) of
   world 4; the ranks read 6, 10, 8 and 9 batches (mid-file, not in lockstep) and save states;
3. elastic: every rank's state resumed as 1 server x 2 ranks, and as 2 servers x 1 rank, on
   fresh data roots.
"""

from __future__ import annotations

import json
import random
import signal
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from client_process import ClientProcess

from conftest import SUPPORT, ServerFactory, tiny_corpus
from queue_client import InvalidRequest, NotServed, QueueClient
from queue_client.format.layout import DatasetLayout
from queue_client.wire import batchqueue_pb2 as pb
from queue_server.testing import ServerProcess

NB = 4  # batches per file, both datasets
DATASETS = ("chars", "text")
OLD_READS = (6, 10, 8, 9)  # batches each old rank reads before its checkpoint
BOUNDARY = 16  # the elastic boundary of those states, from 4 ranks to 2 (docs/ordering.md)
NEW_READS = 20  # batches each new rank reads: every carried file, then one or two of its own


def config(tmp: Path) -> str:
    chars = tiny_corpus(tmp / "chars.txt", chars=20_000)
    rnd = random.Random(5)
    words = "quartz basalt marble slate granite flint shale chalk jasper onyx".split()
    docs = [f"doc {i}: " + " ".join(rnd.choices(words, k=rnd.randint(4, 30))) for i in range(300)]
    text = tmp / "text.txt"
    text.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return textwrap.dedent(
        f"""
        [server]
        lease_ttl_s = 30
        [datasets.chars]
        provider = "char_lm"
        batch_size = 2
        batches_per_file = {NB}
        [datasets.chars.args]
        input = "{chars.as_posix()}"
        block_size = 16
        [datasets.text]
        provider = "text_lm"
        batch_size = 2
        batches_per_file = {NB}
        workers = 2
        [datasets.text.args]
        source = "{text.as_posix()}"
        separator = ""
        seq_len = 32
        micro_batch_size = 2
        eval_take = 20
        shuffle_buffer = 16
        """
    )


@dataclass
class Rank:
    """One trainer rank in its own process, reading both datasets."""

    proc: ClientProcess
    outs: dict[str, Path]

    def batches(self, dataset: str) -> list[dict[str, Any]]:
        lines = self.outs[dataset].read_text().splitlines()
        return [json.loads(line) for line in lines]


def run_ranks(
    tmp: Path,
    tag: str,
    addresses: list[str],
    batches: list[int],
    states: dict[str, Any],
    only: tuple[int, ...] | None = None,
) -> list[Rank]:
    """Rank r of len(addresses) (every one, or those in `only`) reads batches[r] of each
    dataset from addresses[r], loading states[dataset] (one for all ranks) or the rank's own
    state from `states[dataset][r]` (a path) first, and saving its state to
    tag-DATASET-rR.state."""
    ranks = []
    world = len(addresses)
    for r in only if only is not None else range(world):
        jobs = []
        for d in DATASETS:
            job = {"dataset": d, "batches": batches[r], "out": str(tmp / f"{tag}-{d}-r{r}.jsonl")}
            job["state_out"] = str(tmp / f"{tag}-{d}-r{r}.state")
            if isinstance(states.get(d), dict):
                job["state_in"] = str(states[d][r])
            elif d in states:
                path = tmp / f"{tag}-{d}-in.state"
                path.write_text(json.dumps(states[d]))
                job["state_in"] = str(path)
            jobs.append(job)
        spec = tmp / f"{tag}-r{r}.json"
        spec.write_text(
            json.dumps({"address": addresses[r], "rank": r, "world_size": world, "jobs": jobs})
        )
        proc = ClientProcess(SUPPORT / "rank_client.py", [str(spec)])
        ranks.append(Rank(proc, {j["dataset"]: Path(j["out"]) for j in jobs}))
    for r, rank in enumerate(ranks):
        _, err = rank.proc.communicate(timeout=180)
        assert rank.proc.returncode == 0, f"{tag} rank {r} failed:\n{err}"
    return ranks


def start_all(
    factory: ServerFactory, specs: list[tuple[Path, tuple[str, ...], dict[str, str]]], text: str
) -> list[ServerProcess]:
    """Start several servers at once (data root, flags, environment), then wait for each."""
    servers = [
        factory(text, data_root=root, args=args, env=env, wait_serving=False)
        for root, args, env in specs
    ]
    for server in servers:
        server.wait_serving(120)
    return servers


def positions(ranks: list[Rank], dataset: str) -> dict[tuple[int, int], str]:
    """(seq, offset) -> hash of what the ranks read; fails on a position read twice."""
    read = [(b["seq"], b["offset"], b["hash"]) for rank in ranks for b in rank.batches(dataset)]
    twice = [k for k, n in Counter((s, o) for s, o, _ in read).items() if n > 1]
    assert not twice, f"{dataset}: read twice: {twice}"
    return {(s, o): h for s, o, h in read}


def journal_seqs(server: ServerProcess, dataset: str, kind: str) -> set[int]:
    """Seqs of every journal record of `kind` ("p" produced, "a" advanced), all splits."""
    layout = DatasetLayout(server.data_root, dataset)
    seqs = set()
    for split in ("train", "val"):
        path = layout.journal_file(split)
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            if record.get("e") == kind:
                seqs.add(int(record["seq"]))
    return seqs


@dataclass
class Runs:
    tmp: Path
    config: str
    nodes: list[ServerProcess]
    reference: dict[str, dict[tuple[int, int], str]]
    old: list[Rank]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("node-local")
    text = config(tmp)
    factory = ServerFactory(tmp)
    launcher = {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    try:
        ref, a, b = start_all(
            factory,
            [
                (tmp / "ref", (), {}),
                (tmp / "a", ("--ranks", "0,1", "--world-size", "4"), {}),
                (tmp / "b", ("--ranks", "launcher"), launcher),
            ],
            text,
        )
        reference = run_ranks(tmp, "ref", [ref.address] * 4, [5 * NB] * 4, {})
        ref.stop()
        old = run_ranks(tmp, "old", [a.address] * 2 + [b.address] * 2, list(OLD_READS), {})
        yield Runs(tmp, text, [a, b], {d: positions(reference, d) for d in DATASETS}, old)
    finally:
        factory.close()


def test_each_server_makes_only_its_own_ranks_files(runs: Runs) -> None:
    a, b = runs.nodes
    for dataset in DATASETS:
        made_a, made_b = journal_seqs(a, dataset, "p"), journal_seqs(b, dataset, "p")
        assert made_a and made_b
        assert {s % 4 for s in made_a} <= {0, 1}, f"{dataset}: A made {sorted(made_a)}"
        assert {s % 4 for s in made_b} <= {2, 3}, f"{dataset}: B made {sorted(made_b)}"
        assert not made_a & made_b
    # The streaming provider passed its stream through the other node's seqs, writing nothing.
    advanced = journal_seqs(a, "text", "a")
    assert advanced and {s % 4 for s in advanced} <= {2, 3}
    assert not journal_seqs(a, "chars", "a")  # a stateless provider simply skips them
    stats = a.split_stats("text")
    assert [int(r["rank"]) for r in stats["ranks"]] == [0, 1]
    assert stats["seqs_missing"] == 0  # an advanced seq is no produced file gone missing


def test_every_rank_reads_what_one_server_gives_it(runs: Runs) -> None:
    for dataset in DATASETS:
        got = positions(runs.old, dataset)
        assert len(got) == sum(OLD_READS)
        mismatched = {k for k, h in got.items() if runs.reference[dataset][k] != h}
        assert not mismatched, f"{dataset}: {sorted(mismatched)} differ from one server's"


def test_a_restarted_node_server_carries_its_streams_on(runs: Runs) -> None:
    """SIGKILL server B and start it again on its data root: its ranks resume from their
    states and read on exactly what one server gives them; the streaming provider's slots
    resume after the seqs they advanced past, which no produced record shows."""
    tmp = runs.tmp
    b = runs.nodes[1]
    b.kill(signal.SIGKILL)
    factory = ServerFactory(tmp / "restart")
    try:
        (again,) = start_all(
            factory, [(b.data_root, ("--ranks", "2-3", "--world-size", "4"), {})], runs.config
        )
        states = {d: {r: tmp / f"old-{d}-r{r}.state" for r in (2, 3)} for d in DATASETS}
        on = run_ranks(tmp, "restart", [again.address] * 4, [8] * 4, states, only=(2, 3))
    finally:
        factory.close()
    for dataset in DATASETS:
        got = positions(on, dataset)
        assert {s for s, _ in got} == {10, 14, 11, 15, 19}, dataset
        mismatched = {k for k, h in got.items() if runs.reference[dataset][k] != h}
        assert not mismatched, f"{dataset}: {sorted(mismatched)} differ from one server's"


def test_a_rank_at_the_wrong_server_is_told_which_ranks_it_serves(runs: Runs) -> None:
    a, _ = runs.nodes
    request = pb.AcquireLeaseRequest(
        dataset="chars", split="train", rank=2, world_size=4, client_id="c", wait_ms=100
    )
    with pytest.raises(grpc.RpcError) as err:
        a.stub.AcquireLease(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank 2 of world_size 4 is not served here" in err.value.details()
    assert "ranks 0-1 of world_size 4" in err.value.details()
    with QueueClient(a.address, "text", rank=0, world_size=2, timeout_s=30) as client:
        with pytest.raises(
            NotServed, match=r"world_size 2 is not the world .* ranks 0-1 of world_size 4"
        ):
            client.get_batch("train")


def test_a_state_of_another_dataset_or_config_is_refused(runs: Runs) -> None:
    a, _ = runs.nodes
    state = json.loads((runs.tmp / "old-chars-r0.state").read_text())
    assert state["version"] == 3 and state["dataset"] == "chars"
    with QueueClient(a.address, "text", rank=0, world_size=4) as client:
        with pytest.raises(
            InvalidRequest, match="state is for dataset 'chars', this client reads 'text'"
        ):
            client.load_state_dict(state)
    with QueueClient(a.address, "chars", rank=0, world_size=4) as client:
        mine = client.meta["config_fingerprint"]
        other = {**state, "config_fingerprint": "0123456789abcdef"}
        with pytest.raises(InvalidRequest, match=f"'0123456789abcdef'.*{mine}"):
            client.load_state_dict(other)
        rows = NB * client.file_batch_size  # a state's offsets count rows
        beyond = {**state, "splits": {"train": {**state["splits"]["train"], "offset": rows + 1}}}
        with pytest.raises(InvalidRequest, match=f"offset {rows + 1}, but a file holds {rows}"):
            client.load_state_dict(beyond)
        client.load_state_dict(state)  # the state itself loads: nothing was changed above


@pytest.mark.parametrize("shape", ["1 server x 2 ranks", "2 servers x 1 rank"])
def test_a_checkpoint_resumes_on_other_servers_exactly_once(runs: Runs, shape: str) -> None:
    tmp, tag, text = runs.tmp, shape.replace(" ", ""), runs.config
    factory = ServerFactory(tmp / tag)
    states = {
        d: [json.loads((tmp / f"old-{d}-r{r}.state").read_text()) for r in range(4)]
        for d in DATASETS
    }
    try:
        if shape.startswith("1"):
            (server,) = start_all(factory, [(tmp / tag / "root", (), {})], text)
            addresses = [server.address] * 2
        else:
            servers = start_all(
                factory,
                [
                    (tmp / tag / f"root{r}", ("--ranks", str(r), "--world-size", "2"), {})
                    for r in range(2)
                ],
                text,
            )
            addresses = [s.address for s in servers]
        new = run_ranks(tmp, tag, addresses, [NEW_READS] * 2, states)
    finally:
        factory.close()
    for dataset in DATASETS:
        old, resumed = positions(runs.old, dataset), positions(new, dataset)
        assert not old.keys() & resumed.keys(), f"{dataset}: read before and after"
        read = old | resumed
        below = {k for k in read if k[0] < BOUNDARY}
        assert below == {(s, i) for s in range(BOUNDARY) for i in range(NB)}, dataset
        assert len(read) == sum(OLD_READS) + 2 * NEW_READS
        mismatched = {k for k, h in read.items() if runs.reference[dataset][k] != h}
        assert not mismatched, f"{dataset}: {sorted(mismatched)} differ from one server's"
    # New rank 0 read carried files of the other new rank's seqs (9, 11, ...), made anyway.
    assert {s for s, _ in positions(new[:1], "text")} >= {9, 11}
