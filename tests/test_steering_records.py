"""A steering change is checked with the code that applies it before it is journaled, and a
journal's changes are checked before they are replayed: one call can never brick a dataset.

Real servers over the nanogpt_bin mixture of test_mixture_server (each source's rows name it),
restarted on the same data root; rows checked against the pure schedule and each source's own
stream.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
from test_mixture_server import (
    NAMES,
    NB,
    Reference,
    check_rows,
    mixture,
    read,
    schedule,
    write_sources,
)

from queue_client import InvalidRequest, QueueClient
from queue_client.mixture import quantize


def test_weights_whose_sum_overflows_quantize_like_their_ratios() -> None:
    assert quantize([1e308, 1e308, 1]) == (5000, 5000, 0)
    assert quantize([1e308, 5e307]) == quantize([2, 1])
    assert quantize([np.float32(3), np.int64(1)]) == (7500, 2500)
    with pytest.raises(ValueError, match="weight 0 is True"):
        quantize([True, 1.0])


def test_an_overflowing_set_mixture_is_served_on_and_survives_a_restart(
    start_server, tmp_path: Path
) -> None:
    """{web: 1e308, code: 1e308, math: 1} was accepted, journaled, and then failed every file,
    GetStats and every restart on that root. Now its rows are served (half web, half code),
    stats answer, and a restart on the same root serves on."""
    dirs = write_sources(tmp_path)
    config, root = mixture("mix", dirs), tmp_path / "root"
    server = start_server(config, data_root=root)
    ref = Reference(dirs, tmp_path, "mix")
    weights = {"web": 1e308, "code": 1e308, "math": 1.0}
    with QueueClient(server.address, "mix") as client:
        batches = read(client, NB)
        at = client.set_mixture(weights)
        batches += read(client, (at + 3) * NB - len(batches))
        state = client.state_dict()
        stats = client.stats()["splits"]
    mix = next(s for s in stats if s["split"] == "train")["mixture"]
    assert [s["name"] for s in mix["sources"]] == list(NAMES)
    seen = check_rows(batches, schedule([(at, weights)]), ref)
    late = [src for row, src in seen.items() if row >= at * NB * 4]
    assert late and set(late) == {0, 1}  # web and code only, from the change on
    server.kill(signal.SIGKILL)
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "mix") as client:
        client.load_state_dict([state])
        more = read(client, 2 * NB)
    check_rows(more, schedule([(at, weights)]), ref)
    assert "cannot be applied" not in server.log()


def test_numpy_scalars_are_weights_and_alpha(start_server, tmp_path: Path) -> None:
    dirs = write_sources(tmp_path)
    server = start_server(mixture("mix", dirs), data_root=tmp_path / "root")
    with QueueClient(server.address, "mix") as client:
        read(client, 1)
        at = client.set_mixture(
            {"web": np.float32(0.5), "code": np.int64(1), "math": np.float64(0)}
        )
        assert at > 0
        with pytest.raises(InvalidRequest, match="not a number"):
            client.set_mixture({"web": np.bool_(True)})  # type: ignore[dict-item]


def _append_journal(root: Path, record: dict) -> None:
    journal = root / "mix" / "journal" / "train.jsonl"
    with journal.open("a") as f:
        f.write(json.dumps({**record, "v": 1}) + "\n")


@pytest.mark.parametrize(
    "bad",
    [
        {"web": 1.0, "books": 2.0},  # a source the config does not have (renamed since)
        {"web": math.nan},  # written by hand, or by an older server
        {"web": 0.0, "code": 0.0},  # all zero
    ],
    ids=["unknown-source", "nan", "all-zero"],
)
def test_a_journal_record_that_cannot_be_applied_is_named_and_left_out(
    start_server, tmp_path: Path, bad: dict
) -> None:
    """Replay never dies on a steering record it cannot apply: it names the record, leaves it
    out, and the dataset serves the rows the remaining changes give."""
    dirs = write_sources(tmp_path)
    config, root = mixture("mix", dirs), tmp_path / "root"
    server = start_server(config, data_root=root)
    ref = Reference(dirs, tmp_path, "mix")
    with QueueClient(server.address, "mix") as client:
        batches = read(client, NB)
        good = client.set_mixture({"code": 1.0})
        state = client.state_dict()
    server.kill(signal.SIGKILL)
    journal = root / "mix" / "journal" / "train.jsonl"
    assert journal.exists(), sorted(p.name for p in (root / "mix").rglob("*"))
    _append_journal(root, {"e": "mix", "at": good + 40, "weights": bad, "rank": 3})
    _append_journal(root, {"e": "alpha", "at": good + 40, "alpha": 7.5, "rank": 3})
    server = start_server(config, data_root=root)
    with QueueClient(server.address, "mix") as client:
        client.load_state_dict([state])
        batches += read(client, (good + 2) * NB - len(batches))
    check_rows(batches, schedule([(good, {"code": 1.0})]), ref)
    log = server.log()
    assert f"mixture change #2 of the journal (from seq {good + 40}" in log, server.log_tail()
    assert "rank 3) cannot be applied and is left out" in log
    assert "curriculum change #1 of the journal" in log and "7.5" in log
