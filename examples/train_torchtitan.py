"""torchtitan's debug model trained from a batchqueue server with torchtitan's own trainer and
checkpoints: a run killed at any moment resumes on exactly the next rows, also on another
number of ranks.

    queue-server &                                   # serves stdlib_char by default
    torchrun --standalone --nproc_per_node=2 examples/train_torchtitan.py --dump-folder runs/titan
    # killed? the same line resumes from the last checkpoint; --nproc_per_node=4 resumes on
    # 4 ranks, and every row not trained on yet is read once (docs/torchtitan.md)

The config is examples/torchtitan_config.py's batchqueue_debugmodel(). Where no accelerator is
found (a laptop, the tests) the script trains on the CPU with gloo, which torchtitan does not
do by itself; cpu_fallback() says what it changes. Either way it makes torch 2.13 answer the
`torch.distributed.set_timeout` that torchtitan 0.3 calls after the first step.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch.distributed as dist

# Whether cpu_fallback() found no accelerator (None: not asked yet).
_ON_CPU: bool | None = None


def torch_compat() -> None:
    """torchtitan 0.3 calls torch.distributed.set_timeout, which torch 2.13 has as the private
    _set_pg_timeout (same arguments)."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]


class CpuDevice:
    """torch.cpu as torchtitan's device module: the memory statistics it reads are zeros."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def get_device_name(self, *_: Any) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, *_: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 40)

    def memory_stats(self, *_: Any) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, *_: Any) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def cpu_fallback() -> bool:
    """Without an accelerator, make torchtitan train on the CPU; True if it did.

    torchtitan takes "cuda" when it finds no accelerator and reads its device module's memory
    statistics: it is told "cpu" and given CpuDevice. Must run before torchtitan's other
    modules are imported (they copy the device at import)."""
    global _ON_CPU
    if _ON_CPU is not None:
        return _ON_CPU
    import torch._utils

    _ON_CPU = torch._utils._get_available_device_type() is None
    if _ON_CPU:
        torch._utils._get_available_device_type = lambda: "cpu"
        import torchtitan.tools.utils

        torchtitan.tools.utils.device_type = "cpu"
        torchtitan.tools.utils.device_module = CpuDevice()  # type: ignore[assignment]
    return _ON_CPU


def on_cpu(config: Any, world_size: int) -> None:
    """What the debug model needs to train on CPUs: attention whose backward runs there
    (FlexAttention's does not: scaled dot product attention), plain DDP-style replicas (FSDP's
    reduce-scatter uses a reduction gloo lacks) on the DTensor backend (the spmd_types one
    refuses the replicas' plain parameters) and float32 parameters."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.parallelism.data_parallel_replicate_degree = world_size
    config.parallelism.data_parallel_shard_degree = 1
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default=os.environ.get("BATCHQUEUE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--dataset", default="stdlib_char")
    p.add_argument("--seq-len", type=int, default=256, help="the dataset's block_size")
    p.add_argument("--local-batch-size", type=int, default=4, help="rows per rank and step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps")
    p.add_argument("--dump-folder", default="./outputs", help="checkpoints go to FOLDER/checkpoint")
    p.add_argument("--n-layers", type=int, default=0, help="keep this many layers (0: all six)")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace, cpu: bool, trainer_cls: type | None = None) -> Any:
    """The trainer of this rank (torchrun's environment names it), built from the config;
    `cpu`: what cpu_fallback() returned."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchtitan.trainer import Trainer
    from torchtitan_config import batchqueue_debugmodel

    config = batchqueue_debugmodel(
        args.address,
        args.dataset,
        seq_len=args.seq_len,
        local_batch_size=args.local_batch_size,
        steps=args.steps,
        interval=args.interval,
        dump_folder=args.dump_folder,
    )
    if args.n_layers:
        config.model_spec.model.layers = config.model_spec.model.layers[: args.n_layers]
    if cpu:
        on_cpu(config, int(os.environ.get("WORLD_SIZE", "1")))
    trainer = (trainer_cls or Trainer)(config)
    vocab = trainer.dataloader.client.meta.get("vocab_size")
    model_vocab = config.model_spec.model.vocab_size
    if isinstance(vocab, int) and vocab > model_vocab:
        trainer.close()
        raise SystemExit(
            f"dataset {args.dataset!r} has vocab_size {vocab}, more than the model's {model_vocab}"
        )
    return trainer


def main(argv: list[str] | None = None, trainer_cls: type | None = None) -> int:
    args = parse_args(argv)
    torch_compat()
    cpu = cpu_fallback()
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = build_trainer(args, cpu, trainer_cls)
    try:
        trainer.train()
    finally:
        trainer.close()
        trainer.dataloader.close()
    if dist.get_rank() == 0:
        print(f"trained to step {trainer.step} of {args.steps}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
