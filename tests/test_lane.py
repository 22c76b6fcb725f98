"""A stream's background threads (lane.py): every job handed over runs, a close runs the
ones still queued before it returns (releases of finished files among them), and a closed
lane refuses work by name instead of queueing what no thread would run."""

from __future__ import annotations

import threading

import pytest

from conftest import wait_until
from queue_client import errors
from queue_client.streaming.lane import Lane


def _lane_with_held_threads(threads: int) -> tuple[Lane, threading.Event]:
    """A lane whose every thread runs a job that waits for the event returned."""
    lane = Lane("queue-client-test", threads, "the test stream")
    gate = threading.Event()
    for _ in range(threads):
        lane.put(lambda: gate.wait(60))
    return lane, gate


def test_one_put_hands_over_several_jobs_and_each_runs_once_on_a_lane_thread() -> None:
    lane = Lane("queue-client-test", 3, "the test stream")
    ran: list[tuple[int, str]] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            ran.append((i, threading.current_thread().name))

    try:
        lane.put_all([lambda i=i: job(i) for i in range(5)])
        wait_until(lambda: len(ran) == 5, 60, "five jobs run")
        assert sorted(i for i, _ in ran) == [0, 1, 2, 3, 4]
        assert all(name.startswith("queue-client-test-") for _, name in ran)
    finally:
        lane.close()


def test_close_runs_every_job_handed_over_first_even_those_a_spread_put_back() -> None:
    # Both threads busy: what close finds queued (a spread whose jobs go back on the queue
    # behind close's own stop marks) still runs before close returns.
    lane, gate = _lane_with_held_threads(2)
    ran: list[int] = []
    lane.put_all([lambda: ran.append(1), lambda: ran.append(2), lambda: ran.append(3)])
    lane.put(lambda: ran.append(4))
    closer = threading.Thread(target=lane.close)
    closer.start()
    gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert sorted(ran) == [1, 2, 3, 4]
    assert not [t for t in threading.enumerate() if t.name.startswith("queue-client-test-")]


def test_a_failing_job_is_logged_and_the_lane_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane("queue-client-test", 1, "the test stream")
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    try:
        lane.put(boom)
        lane.put(done.set)
        assert done.wait(60)
    finally:
        lane.close()
    assert "boom" in caplog.text and "queue-client-test" in caplog.text


def test_a_closed_lane_refuses_work_naming_its_owner() -> None:
    lane = Lane("queue-client-test", 1, "the chars/train stream")
    lane.close()
    lane.close()  # idempotent
    with pytest.raises(errors.InvalidRequest, match="chars/train stream was closed"):
        lane.put(lambda: None)
    with pytest.raises(errors.InvalidRequest, match="chars/train stream was closed"):
        lane.put_all([lambda: None, lambda: None])
    with pytest.raises(ValueError, match="at least one thread"):
        Lane("queue-client-test", 0, "nothing")


def test_stop_ends_the_threads_after_the_jobs_handed_over_without_waiting_for_them() -> None:
    lane, gate = _lane_with_held_threads(1)
    ran: list[int] = []
    lane.put(lambda: ran.append(1))
    lane.stop()  # returns at once, with a job still running
    assert not gate.is_set()
    with pytest.raises(errors.InvalidRequest):
        lane.put(lambda: None)
    gate.set()
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("queue-client-test-")],
        60,
        "the lane's threads to end",
    )
    assert ran == [1]
