"""examples/lightning_train.py (QueueDataModule, MixtureReweighting) under Lightning's own DDP
launcher on CPU (gloo), against a real server: a run SIGKILLed after a checkpoint, resumed
from that checkpoint on 2 devices and on 1, reads the rows an uninterrupted run reads, while
the mixture's weights move every 2 steps from each source's loss.

Each rank records every step's rows. One server serves two datasets of one config: "ref" for
the uninterrupted run and "run" for the killed one and its resumes, so each has its own
stream and its own journal of weight changes, with the same rows at every seq."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from support.trainer_runs import TrainerRun, rows

from conftest import ROOT, char_config, subprocess_env, tiny_corpus, wait_until

pytest.importorskip(
    "lightning", reason="lightning is not installed: pip install -e '.[lightning]' (make setup)"
)

B, NB = 4, 2  # rows per batch, batches per file: a rank starts a new file every 2 steps
STEPS = 16  # the uninterrupted run's: each rank reads 8 files (seqs 0..15 in all)
SAVE = 3  # a checkpoint every 3 steps: step 3 stands mid-file (seq 2 and 3, row 4)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def mixture_config(tmp: Path) -> str:
    """Two sources: "easy" repeats a pattern (its loss falls at once), "hard" is noise, so the
    weights move toward hard; max_backlog_files = 1 makes a change land a few files ahead."""
    rng = np.random.default_rng(0)
    data = {
        "easy": np.tile(np.arange(0, 10, dtype=np.uint16), 400),
        "hard": rng.integers(100, 200, size=4000).astype(np.uint16),
    }
    # The resumes take the killed run's leases over: a trainer restarted within the lease TTL.
    # (Once they expire, the server makes files past the dead run's read-ahead, and a weight
    # change sent again after the resume lands on a later seq than it did uninterrupted.)
    config = "[server]\nlease_ttl_s = 600\n"
    for name, ids in data.items():
        (tmp / name).mkdir()
        for split in ("train", "val"):
            ids.tofile(tmp / name / f"{split}.bin")
    for dataset in ("ref", "run"):
        config += f"[datasets.{dataset}]\nbatch_size = {B}\nbatches_per_file = {NB}\n"
        config += "max_backlog_files = 1\n"
        for name in data:
            config += textwrap.dedent(
                f"""
                [datasets.{dataset}.sources.{name}]
                provider = "nanogpt_bin"
                weight = 0.5
                [datasets.{dataset}.sources.{name}.args]
                data_dir = "{(tmp / name).as_posix()}"
                block_size = 8
                vocab_size = 200
                """
            )
    return config


def launch(tmp: Path, tag: str, address: str, dataset: str, devices: int, max_steps: int,
           resume: Path | None = None) -> TrainerRun:  # fmt: skip
    folder = tmp / tag
    command = [
        sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--address", address,
        "--dataset", dataset, "--devices", str(devices), "--max-steps", str(max_steps),
        "--save-every", str(SAVE), "--ckpt-dir", str(folder / "ckpt"), "--lr", "2",
        "--reweight-every", "2", "--eta", "4", "--record", str(folder / "record"),
    ]  # fmt: skip
    if resume is not None:
        command += ["--resume", str(resume)]
    return TrainerRun(folder, command, subprocess_env(**ONE_THREAD), folder / "record")


def reweighted(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("reweighted at step")]


@pytest.mark.timeout(600)  # four Lightning runs; on a quiet 2-core machine about a minute
def test_a_killed_run_resumes_exactly_on_two_devices_and_on_one(
    start_server, tmp_path: Path
) -> None:
    server = start_server(mixture_config(tmp_path))
    ref = launch(tmp_path, "ref", server.address, "ref", 2, STEPS)
    killed = launch(tmp_path, "killed", server.address, "run", 2, 1000)
    checkpoint = tmp_path / "killed" / "ckpt" / f"step{SAVE:04d}.ckpt"
    # Past the checkpoint on both ranks (so it was written whole), then killed mid-run.
    wait_until(lambda: killed.reached(2, SAVE + 2), 400, "the killed run to pass its checkpoint")
    killed.kill()
    assert checkpoint.is_file()
    ref_out = ref.finish(400)
    assert f"done at step {STEPS}" in ref_out

    same = launch(tmp_path, "same", server.address, "run", 2, STEPS, resume=checkpoint)
    same_out = same.finish(400)
    assert f"done at step {STEPS}" in same_out
    for r in range(2):
        expected = rows(ref.steps(r), 1, STEPS)
        assert rows(killed.steps(r), 1, SAVE) == expected[:SAVE], f"rank {r} before the kill"
        assert rows(same.steps(r), SAVE + 1, STEPS) == expected[SAVE:], f"rank {r} resumed"
        assert not [s for s in same.steps(r) if s["step"] <= SAVE]  # nothing trained twice
    # The same weights, sent at the same steps, landing on the same seqs.
    assert reweighted(same_out) == reweighted(ref_out) and len(reweighted(ref_out)) == STEPS // 2
    # The callback moved the weights toward the hard source, and the rows compared include
    # files drawn under moved weights (seqs up to 2 * STEPS - 1).
    lines = reweighted(ref_out)
    assert int(lines[0].rsplit("from seq ", 1)[1].rstrip(")")) <= 2 * STEPS - 4, lines
    assert float(lines[-1].split(", ")[1].split()[0]) > 0.9, lines  # hard's final weight

    # On one device from the same checkpoint: rank 0 stood at seq 2 row 4 (next 4), rank 1
    # at seq 3 row 4 (next 5). To 1 rank (docs/ordering.md): B = 6, the carried files are
    # (2, 4), (3, 4), (4, 0), (5, 0), then seq 6 on. Seqs up to 6 hold no weight change of
    # any run (the earliest lands at seq 7 or later), so each batch is the reference's batch
    # at that place.
    one = launch(tmp_path, "one", server.address, "run", 1, SAVE + 8, resume=checkpoint)
    assert f"done at step {SAVE + 8}" in one.finish(400)
    r0, r1 = rows(ref.steps(0), 1, STEPS), rows(ref.steps(1), 1, STEPS)
    expected = [r0[3], r1[3], r0[4], r0[5], r1[4], r1[5], r0[6], r0[7]]
    assert rows(one.steps(0), SAVE + 1, SAVE + 8) == expected


def test_a_module_that_hides_the_datamodules_hook_is_refused(start_server, tmp_path: Path) -> None:
    """A LightningModule's own on_before_batch_transfer would replace the DataModule's, which
    marks each batch trained on: fit refuses it at setup, naming the hook."""
    import lightning.pytorch as pl

    from queue_client import InvalidRequest
    from queue_client.integrations.lightning import QueueDataModule

    class Hides(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def on_before_batch_transfer(self, batch: object, dataloader_idx: int) -> object:
            return batch

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            return self.w.sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    server = start_server(char_config(tiny_corpus(tmp_path / "corpus.txt")))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    datamodule = QueueDataModule(server.address, "chars")
    with pytest.raises(InvalidRequest, match="Hides defines on_before_batch_transfer"):
        trainer.fit(Hides(), datamodule=datamodule)
    with pytest.raises(InvalidRequest, match="is not open"):
        datamodule.client  # noqa: B018  (nothing was opened)
