"""One torchtitan training job of the resume tests: WORLD ranks of examples/train_torchtitan.py,
each a process forked from this one after it imported torchtitan (a second import per rank
would cost some ten seconds of CPU each), rendezvousing over gloo as torchrun's would.

    python titan_ranks.py SPEC.json

SPEC: {"world_size", "master_port", "rows_dir", "argv": [the example's flags]}. Each rank
writes rows_dir/rank-R.jsonl, one line per step it trains: {"step", "rows": [the row numbers
of its batch]} (bq_titan_providers.row_of), flushed at once, so a job killed mid-run leaves
every step it began. Exits with the first failing rank's status, after stopping the others.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import train_torchtitan  # noqa: E402

train_torchtitan.torch_compat()
CPU = train_torchtitan.cpu_fallback()

import torch  # noqa: E402
from bq_titan_providers import row_of  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402
from torchtitan_config import batchqueue_debugmodel  # noqa: E402, F401  (imported before fork)


class RecordingTrainer(Trainer):
    """torchtitan's trainer, writing down the rows of every batch it trains on."""

    rows_out: Any = None

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):  # type: ignore[no-untyped-def]
        rows = [row_of(r) for r in input_dict["input"][:, :2].tolist()]
        self.rows_out.write(json.dumps({"step": self.step, "rows": rows}) + "\n")
        self.rows_out.flush()
        return super().post_dataloading_process(input_dict, labels)


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    world = spec["world_size"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["master_port"]),
    )  # fmt: skip
    torch.set_num_threads(1)
    RecordingTrainer.rows_out = open(Path(spec["rows_dir"]) / f"rank-{rank}.jsonl", "a")
    code = train_torchtitan.main(spec["argv"], trainer_cls=RecordingTrainer)
    RecordingTrainer.rows_out.close()
    sys.stdout.flush()
    os._exit(code)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    children = []
    for rank in range(spec["world_size"]):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(rank, spec)
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
        children.append(pid)
    status = 0
    for _ in children:
        pid, code = os.wait()
        code = os.waitstatus_to_exitcode(code)
        if code != 0 and status == 0:
            status = code if code > 0 else 1
            for other in children:
                if other != pid:
                    try:
                        os.kill(other, 9)
                    except ProcessLookupError:
                        pass
    return status


if __name__ == "__main__":
    sys.exit(main())
