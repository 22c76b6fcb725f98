"""examples/hf_trainer_train.py (QueueTrainer) against a real server: a one-process run
SIGKILLed after checkpoint-3, resumed from that checkpoint on one process and under torchrun
on two (gloo), reads the rows an uninterrupted run reads, with no batch replayed.

Each process records every step's rows. One server serves two datasets of one config: "ref"
for the uninterrupted run and "run" for the killed one and its resumes, with the same rows at
every seq."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.trainer_runs import TrainerRun, rows

from conftest import ROOT, char_config, subprocess_env, tiny_corpus, wait_until

pytest.importorskip(
    "transformers",
    reason="transformers is not installed: pip install -e '.[hf-trainer]' (make setup)",
)
pytest.importorskip(
    "accelerate", reason="accelerate is not installed: pip install -e '.[hf-trainer]' (make setup)"
)

from queue_client import InvalidRequest
from queue_client.integrations.hf_trainer import STATE_FILE, QueueTrainer, read_states

B, NB = 4, 5  # rows per batch (per_device_train_batch_size too), batches per file
SAVE = 3  # checkpoint-3 stands mid-file: seq 0, row 12
STEPS = 13  # the uninterrupted run's: seqs 0, 1 and 3 batches of seq 2
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def launch(tmp: Path, tag: str, address: str, dataset: str, procs: int, max_steps: int,
           resume: Path | None = None) -> TrainerRun:  # fmt: skip
    folder = tmp / tag
    script = [str(ROOT / "examples" / "hf_trainer_train.py"), "--address", address, "--dataset",
              dataset, "--max-steps", str(max_steps), "--save-steps", str(SAVE), "--batch-size",
              str(B), "--output-dir", str(folder / "out"), "--record", str(folder / "record")]  # fmt: skip
    if resume is not None:
        script += ["--resume", str(resume)]
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    return TrainerRun(folder, launcher + script, subprocess_env(**ONE_THREAD), folder / "record")


@pytest.mark.timeout(600)  # four Trainer runs; on a quiet 2-core machine about a minute
def test_a_killed_run_resumes_exactly_on_one_process_and_on_two(
    start_server, tmp_path: Path
) -> None:
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    # The resumes take the killed run's leases over: a trainer restarted within the lease TTL.
    config = "[server]\nlease_ttl_s = 600\n"
    for name in ("ref", "run"):
        config += char_config(corpus, name=name, batch_size=B, block_size=8, batches_per_file=NB,
                              server=None)  # fmt: skip
    server = start_server(config)
    ref = launch(tmp_path, "ref", server.address, "ref", 1, STEPS)
    killed = launch(tmp_path, "killed", server.address, "run", 1, 1000)
    checkpoint = tmp_path / "killed" / "out" / f"checkpoint-{SAVE}"
    wait_until(lambda: killed.reached(1, SAVE + 2), 400, "the killed run to pass checkpoint-3")
    killed.kill()
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    assert [s["splits"]["train"]["seq"] for s in saved["states"]] == [0]
    assert [s["splits"]["train"]["offset"] for s in saved["states"]] == [SAVE * B]
    assert f"done at step {STEPS}" in ref.finish(400)
    expected = rows(ref.steps(0), 1, STEPS)
    assert rows(killed.steps(0), 1, SAVE) == expected[:SAVE]

    same = launch(tmp_path, "same", server.address, "run", 1, STEPS, resume=checkpoint)
    assert f"done at step {STEPS}" in same.finish(400)
    assert rows(same.steps(0), SAVE + 1, STEPS) == expected[SAVE:]
    assert not [s for s in same.steps(0) if s["step"] <= SAVE]  # nothing replayed

    # On two processes from the same checkpoint. The one rank stood at seq 0 row 12 (next 1).
    # To 2 ranks (docs/ordering.md): B = 2, the carried files (0, 12) and (1, 0) go to ranks
    # 0 and 1, then seqs 2, 4, ... and 3, 5, ...
    two = launch(tmp_path, "two", server.address, "run", 2, SAVE + 5, resume=checkpoint)
    assert f"done at step {SAVE + 5}" in two.finish(400)
    e = dict(enumerate(expected, start=1))  # the reference's batch of each step
    assert rows(two.steps(0), SAVE + 1, SAVE + 5) == [e[4], e[5], e[11], e[12], e[13]]
    assert rows(two.steps(1), SAVE + 1, SAVE + 5) == [e[6], e[7], e[8], e[9], e[10]]
    # And the checkpoint the two processes saved at step 6 holds both ranks' states.
    states = read_states(tmp_path / "two" / "out" / f"checkpoint-{2 * SAVE}")
    assert [(s["rank"], s["world_size"]) for s in states] == [(0, 2), (1, 2)]


def test_what_would_replay_or_lose_rows_is_refused(start_server, tmp_path: Path) -> None:
    """Skipping batches on resume, DataLoader workers, a train_dataset beside the queue, and a
    checkpoint without the loader's states are refused, each naming what to change."""
    from transformers import TrainingArguments

    server = start_server(char_config(tiny_corpus(tmp_path / "corpus.txt")))
    model = torch.nn.Linear(1, 1)

    def make(**overrides: object) -> QueueTrainer:
        settings: dict = {"output_dir": str(tmp_path / "out"), "max_steps": 1, "use_cpu": True,
                          "report_to": [], "ignore_data_skip": True, **overrides}  # fmt: skip
        return QueueTrainer(model=model, args=TrainingArguments(**settings),
                            address=server.address, dataset="chars")  # fmt: skip

    with pytest.raises(InvalidRequest, match="ignore_data_skip=True"):
        make(ignore_data_skip=False)
    with pytest.raises(InvalidRequest, match="dataloader_num_workers=2"):
        make(dataloader_num_workers=2)
    with pytest.raises(InvalidRequest, match="pass no train_dataset"):
        QueueTrainer(model=model, train_dataset=[1], address=server.address, dataset="chars")
    folder = tmp_path / "out" / "checkpoint-7"
    folder.mkdir(parents=True)
    with pytest.raises(InvalidRequest, match=f"checkpoint-7/{STATE_FILE} is missing"):
        make().train(resume_from_checkpoint=str(folder))
    (folder / STATE_FILE).write_text('{"version": 9, "states": []}')
    with pytest.raises(InvalidRequest, match="expected a batchqueue loader record of version 1"):
        read_states(folder)
