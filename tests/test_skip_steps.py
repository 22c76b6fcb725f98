"""SkipSteps: global steps [a, b) leave every rank's stream, from one caller, and every later
resume agrees: a checkpoint from before the call skips them too, one inside the range goes on
at b. Real servers (one alone, restarted; two node-local ones sharing a control plane), real
clients; every batch is held against a run that skipped nothing, step for step.
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
import torch
from support.control_store import ControlStore

from conftest import subprocess_env
from queue_client import InvalidRequest, QueueClient

BPF = 3
CONFIG = textwrap.dedent(
    f"""
    [datasets.d]
    provider = "bq_test_providers:TinyProvider"
    batch_size = 2
    batches_per_file = {BPF}
    max_backlog_files = 1
    workers = 1
    """
)
W, STEPS, SKIP = 2, 30, (16, 22)


def lockstep(clients: list[QueueClient], steps: range, skip_at: int | None = None) -> dict:
    """{rank: {step: x}}: every rank reads one batch a step; rank 0 calls skip_steps(SKIP)
    after its batch of step skip_at. Steps are the clients' own counters."""
    seen: dict[int, dict[int, torch.Tensor]] = {r: {} for r in range(len(clients))}
    for s in steps:
        for r, c in enumerate(clients):
            if c.state_dict()["splits"].get("train", {}).get("step", 0) >= STEPS:
                continue
            x = c.get_batch("train")[0].clone()
            seen[r][c.state_dict()["splits"]["train"]["step"] - 1] = x  # the batch's step
            if s == skip_at and r == 0:
                c.skip_steps(*SKIP)
    return seen


def reference(start_server, tmp: Path) -> tuple[dict, list]:
    """Every step of both ranks with nothing skipped, and their states at step 18."""
    server = start_server(CONFIG, data_root=tmp / "ref")
    clients = [QueueClient(server.address, "d", rank=r, world_size=W) for r in range(W)]
    seen = lockstep(clients, range(18))
    inside = [c.state_dict() for c in clients]
    more = lockstep(clients, range(18, STEPS))
    for r in seen:
        seen[r].update(more[r])
    for c in clients:
        c.close()
    return seen, inside


def expect_skipped(got: dict, want: dict, first: int = 0) -> None:
    a, b = SKIP
    for r, steps in got.items():
        served = sorted(steps)
        assert not set(served) & set(range(a, b)), f"rank {r} served skipped steps"
        assert served == [s for s in range(first, STEPS) if not a <= s < b], (r, served)
        for s in served:
            assert torch.equal(steps[s], want[r][s]), f"rank {r} step {s}"


def test_one_call_skips_the_steps_on_every_rank_and_across_resumes(
    start_server, tmp_path: Path
) -> None:
    want, inside = reference(start_server, tmp_path)
    root = tmp_path / "root"
    server = start_server(CONFIG, data_root=root)
    clients = [QueueClient(server.address, "d", rank=r, world_size=W) for r in range(W)]
    got = lockstep(clients, range(2))
    before = [c.state_dict() for c in clients]  # a checkpoint from before the call
    with pytest.raises(InvalidRequest, match=r"earliest step that can be skipped now is 1[0-9]"):
        clients[0].skip_steps(5, 8)  # in files a rank may have leased already
    with pytest.raises(InvalidRequest, match=r"steps \[30, 20\) are not a range"):
        clients[0].skip_steps(30, 20)
    with pytest.raises(InvalidRequest, match=r"from_step is 16\.5, not a whole number"):
        clients[0].skip_steps(16.5, 20)  # type: ignore[arg-type]
    more = lockstep(clients, range(2, STEPS), skip_at=2)
    for r in got:
        got[r].update(more[r])
    expect_skipped(got, want)
    for c in clients:
        c.close()
    # The skip is journaled: after a SIGKILL, a resume from before the call skips it too.
    server.kill(signal.SIGKILL)
    server = start_server(CONFIG, data_root=root)
    resumed = [QueueClient(server.address, "d", rank=r, world_size=W) for r in range(W)]
    for c in resumed:
        c.load_state_dict(before)
    expect_skipped(lockstep(resumed, range(2, STEPS + 10)), want, first=2)
    for c in resumed:
        c.close()
    # A checkpoint inside the range (a run that never heard of the skip) goes on at its end.
    inside_run = [QueueClient(server.address, "d", rank=r, world_size=W) for r in range(W)]
    for c in inside_run:
        c.load_state_dict(inside)
    expect_skipped(lockstep(inside_run, range(STEPS + 10)), want, first=SKIP[1])
    for c in inside_run:
        c.close()


def test_a_skip_from_rank_0_reaches_the_ranks_of_every_server(start_server, tmp_path: Path) -> None:
    want4: dict[int, dict] = {}
    ref = start_server(CONFIG, data_root=tmp_path / "ref")
    clients = [QueueClient(ref.address, "d", rank=r, world_size=4) for r in range(4)]
    want4 = lockstep(clients, range(STEPS))
    for c in clients:
        c.close()
    store = ControlStore(tmp_path / "store", subprocess_env())
    try:
        nodes = [
            start_server(
                CONFIG,
                data_root=tmp_path / f"n{i}",
                args=("--ranks", ranks, "--world-size", "4", "--control-plane", store.url),
            )
            for i, ranks in enumerate(("0,1", "2,3"))
        ]
        clients = [QueueClient(nodes[r // 2].address, "d", rank=r, world_size=4) for r in range(4)]
        got = lockstep(clients, range(STEPS), skip_at=2)
        for c in clients:
            c.close()
    finally:
        store.kill()
    expect_skipped(got, want4)


def test_a_rank_fed_by_a_fetch_helper_skips_what_another_rank_asked_mid_run(
    start_server, tmp_path: Path
) -> None:
    """Rank 1 reads through its fetch helper process, which leases: the skip rank 0 asks for
    at step 2 reaches it through the helper's lease replies, before step 16."""
    want, _ = reference(start_server, tmp_path)
    server = start_server(CONFIG, data_root=tmp_path / "root")
    clients = [
        QueueClient(server.address, "d", rank=r, world_size=W, fetch_process=r == 1)
        for r in range(W)
    ]
    try:
        got = lockstep(clients, range(STEPS), skip_at=2)
    finally:
        for c in clients:
            c.close()
    expect_skipped(got, want)


def test_a_plan_advanced_by_rows_and_the_files_it_passes_over() -> None:
    from queue_client.streaming.resume import StreamPlan
    from queue_client.streaming.skipping import StepSkips, advanced, passed_over

    plain = StreamPlan(((4, 2),), 6)  # rank 0 of 2, 6 rows a file, 2 rows into seq 4
    assert advanced(plain, 3, 6, 2) == StreamPlan(((4, 5),), 6)
    assert advanced(plain, 4, 6, 2) == StreamPlan((), 6)
    assert advanced(plain, 4 + 6 * 2 + 1, 6, 2) == StreamPlan(((10, 1),), 12)
    assert passed_over(plain, advanced(plain, 4 + 6 * 2 + 1, 6, 2), 2) == {4, 6, 8}
    assert passed_over(plain, advanced(plain, 3, 6, 2), 2) == frozenset()
    carried = StreamPlan(((9, 0), (3, 4)), 20)  # files carried by an elastic resume first
    assert advanced(carried, 6 + 1, 6, 4) == StreamPlan(((3, 5),), 20)
    assert passed_over(carried, advanced(carried, 6 + 2 + 6, 6, 4), 4) == {9, 3, 20}

    skips = StepSkips(step=10)
    assert skips.check_needed() is False
    skips.learn([(12, 15), (15, 18), (30, 31)])
    assert skips.check_needed() and skips.due() is None and skips.next_at == 12
    skips.step = 12
    assert skips.check_needed() and skips.due() == 18  # ranges that touch: to the end of both
    skips = StepSkips(step=16)
    skips.learn([(12, 15), (15, 18)])
    assert skips.due() == 18  # a resume inside a range goes on at its end
