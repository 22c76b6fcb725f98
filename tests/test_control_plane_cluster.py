"""A cluster on this machine: 8 node-local servers x 2 ranks (16 ranks) on a three-source
mixture of token_shards corpora, sharing one control plane. Rank 0 alone reweights the
mixture and skips a range of steps; one server is SIGKILLed and replaced by a fresh one on an empty root, its ranks
resumed from their checkpoint; then the job resumes at 8 ranks (4 servers x 2) from the 16
states. Every rank's rows equal those of one server serving the same steps: none lost, none
twice. Slow (13 servers on 2 cores): `make test` leaves it out, `pytest -m slow` runs it.
"""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.control_store import ControlStore
from support.mixture_reads import read_positioned
from support.token_files import write_raw

from conftest import ServerFactory, subprocess_env
from queue_client import QueueClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NAMES = ("web", "code", "math")
B, NB, T = 2, 4, 8
NEW = {"web": 0.2, "code": 0.2, "math": 0.6}
SKIP = (28, 32)  # steps of every rank, skipped on rank 0's call at step 2 of phase one


def config(tmp: Path) -> str:
    text = f"[datasets.mix]\nbatch_size = {B}\nbatches_per_file = {NB}\nmax_backlog_files = 1\n"
    for i, name in enumerate(NAMES):
        rng = np.random.default_rng(i)
        path = write_raw(
            tmp / f"{name}.bin", rng.integers(i * 100, i * 100 + 100, 20_000).astype(np.uint16)
        )
        text += textwrap.dedent(
            f"""
            [datasets.mix.sources.{name}]
            provider = "token_shards"
            weight = {(0.5, 0.3, 0.2)[i]}
            [datasets.mix.sources.{name}.args]
            inputs = {json.dumps([path.as_posix()])}
            block_size = {T}
            vocab_size = 300
            """
        )
    return text


def step(clients: dict[int, QueueClient], rows: dict[int, list], call: bool, skip=False) -> None:
    for r in sorted(clients):
        rows.setdefault(r, []).extend(read_positioned(clients[r], 1, "x"))
        if call and r == 0:
            clients[r].set_mixture(NEW)
        if skip and r == 0:
            clients[r].skip_steps(*SKIP)


def run(tmp: Path, servers: Any, phases: tuple[int, int, int], call_at: int) -> dict:
    """phases: steps before the lost node, steps to the checkpoint, steps after the elastic
    resume. `servers(world, kind)` gives {rank: address} for the phase."""
    rows: dict[int, list] = {}
    first, second, third = phases
    addresses = servers(16, "start")
    clients = {
        r: QueueClient(addresses[r], "mix", rank=r, world_size=16, reconnect_timeout_s=2)
        for r in range(16)
    }
    for s in range(first):
        step(clients, rows, s == call_at, skip=s == 2)
    states = {r: c.state_dict() for r, c in clients.items()}
    replaced = servers(16, "lose")  # the ranks whose server was replaced, and its address
    for r, address in replaced.items():
        clients[r].close()  # its server is gone: it gives up within its reconnect timeout
        clients[r] = QueueClient(address, "mix", rank=r, world_size=16)
        clients[r].load_state_dict([states[q] for q in range(16)])
    for s in range(first, first + second):
        step(clients, rows, s == call_at)
    checkpoint = [clients[r].state_dict() for r in range(16)]
    for c in clients.values():
        c.close()
    addresses = servers(8, "elastic")
    resumed = {r: QueueClient(addresses[r], "mix", rank=r, world_size=8) for r in range(8)}
    for c in resumed.values():
        c.load_state_dict(checkpoint)
    after: dict[int, list] = {}
    for _ in range(third):
        step(resumed, after, False)
    for c in resumed.values():
        c.close()
    return {"before": rows, "after": after}


def test_sixteen_ranks_on_eight_servers_read_what_one_server_gives(tmp_path: Path) -> None:
    text = config(tmp_path)
    phases, call_at = (3 * NB, 5 * NB, 4 * NB), NB + 1
    factory = ServerFactory(tmp_path / "servers")
    try:
        one = factory(text, data_root=tmp_path / "one")

        def single(world: int, kind: str) -> dict[int, str]:
            return {} if kind == "lose" else {r: one.address for r in range(world)}

        want = run(tmp_path, single, phases, call_at)
        one.kill(signal.SIGKILL)

        store = ControlStore(tmp_path / "store", subprocess_env())
        nodes: dict[int, Any] = {}

        def node(i: int, world: int, root: str) -> Any:
            ranks = f"{2 * i},{2 * i + 1}"
            args = ("--ranks", ranks, "--world-size", str(world), "--control-plane", store.url)
            return factory(text, data_root=tmp_path / root, args=args)

        def cluster(world: int, kind: str) -> dict[int, str]:
            if kind == "start":
                for i in range(8):
                    nodes[i] = node(i, 16, f"n{i}")
                return {r: nodes[r // 2].address for r in range(16)}
            if kind == "lose":
                nodes[3].kill(signal.SIGKILL)
                nodes[3] = node(3, 16, "fresh3")
                return {6: nodes[3].address, 7: nodes[3].address}
            for i in range(8):
                nodes[i].kill(signal.SIGTERM)
            fresh = [node(i, 8, f"e{i}") for i in range(4)]
            return {r: fresh[r // 2].address for r in range(8)}

        got = run(tmp_path, cluster, phases, call_at)
        store.kill()
    finally:
        factory.close()
    for phase in ("before", "after"):
        assert sorted(got[phase]) == sorted(want[phase])
        for r in want[phase]:
            for i, (a, b) in enumerate(zip(got[phase][r], want[phase][r], strict=True)):
                where = f"{phase} rank {r} batch {i}"
                assert (a["seq"], a["offset"]) == (b["seq"], b["offset"]), where
                assert torch.equal(a["x"], b["x"]) and torch.equal(a["source"], b["source"]), where
    for r in want["before"]:  # steps 28-31 (file round 7) skipped: each rank jumped to 32
        # A batch's position is read before its call, so the call that skips is labelled
        # with round 7; its batch and the next three are round 8's (steps 32-35).
        seqs = [b["seq"] for b in want["before"][r]]
        assert seqs.count(r + 16 * 7) == 1 and seqs.count(r + 16 * 8) == 3, seqs
    sources = torch.cat([b["source"] for r in got["after"] for b in got["after"][r]])
    assert int((sources == 2).sum()) > len(sources) // 2  # the new weights hold after the resume
