"""char_diffusion: masked character reconstruction, the training signal of a masked-diffusion LM.

Each sample is a random window of block_size characters. Every position is masked
independently with the sample's mask rate: x holds the window with masked positions replaced by
the [MASK] id (one past the last character), y holds the original character at masked positions
and -100 elsewhere, so cross_entropy(ignore_index=-100) scores exactly the masked positions.

The mask rate follows `stages`, a curriculum over the train split's batch stream: each stage has
a fixed rate or a [lo, hi] range (each sample draws its rate uniformly from it, as masked
diffusion draws a noise level per sequence) and lasts `batches` batches; the last stage lasts
for the rest of the run. A batch's stage is fixed by its position in the stream
(file seq * batches_per_file + index in file), so a file stays a pure function of its seq.
Other splits always use the last stage, so validation loss is comparable across a run.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError
from queue_client.format.batchfile import EncodedBatchFile
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.char_lm import stdlib_corpus
from queue_providers.compact import labels, token_ids
from queue_providers.inputs import Input
from queue_providers.remote import read_text, resolve, shown, store_for
from queue_providers.tokenized.rows import IGNORE_INDEX

MASK_TOKEN = "[MASK]"
DEFAULT_STAGES = ({"mask_rate": [0.05, 1.0]},)


@dataclass(frozen=True)
class Stage:
    """Mask rates drawn uniformly from [lo, hi] (lo == hi: a fixed rate) for `batches` batches
    (None: for the rest of the run)."""

    lo: float
    hi: float
    batches: int | None

    def to_dict(self) -> dict[str, Any]:
        rate: Any = self.lo if self.lo == self.hi else [self.lo, self.hi]
        return {"mask_rate": rate, "batches": self.batches}


def parse_stages(raw: Sequence[Mapping[str, Any]]) -> tuple[Stage, ...]:
    """Config stages, checked: rates in (0, 1], every stage but the last has batches > 0."""
    if isinstance(raw, (str, Mapping)) or not raw:
        raise ConfigError(f"char_diffusion: stages must be a non-empty list of tables, got {raw!r}")
    stages = []
    for i, item in enumerate(raw):
        where = f"char_diffusion: stages[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where} must be a table like {{mask_rate = 0.15, batches = 1000}}")
        unknown = sorted(set(item) - {"mask_rate", "batches"})
        if unknown:
            raise ConfigError(
                f"{where} has unknown key(s) {unknown}; expected mask_rate and batches"
            )
        if "mask_rate" not in item:
            raise ConfigError(f"{where} lacks mask_rate")
        rate = item["mask_rate"]
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            lo = hi = float(rate)
        elif (
            isinstance(rate, (list, tuple))
            and len(rate) == 2
            and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rate)
        ):
            lo, hi = float(rate[0]), float(rate[1])
        else:
            raise ConfigError(f"{where}.mask_rate must be a number or [lo, hi], got {rate!r}")
        if not 0.0 < lo <= hi <= 1.0:
            raise ConfigError(f"{where}.mask_rate {rate!r} must satisfy 0 < lo <= hi <= 1")
        batches = item.get("batches")
        last = i == len(raw) - 1
        if last and batches is not None:
            raise ConfigError(
                f"{where} is the last stage, which lasts for the rest of the run: drop its batches"
            )
        if not last and (not isinstance(batches, int) or isinstance(batches, bool) or batches <= 0):
            raise ConfigError(
                f"{where}.batches must be a positive int (every stage but the last ends), got {batches!r}"
            )
        stages.append(Stage(lo, hi, batches))
    return tuple(stages)


def encode_chars(text: str) -> tuple[np.ndarray, list[str]]:
    """Each character's index in the sorted character set, and that set."""
    chars = sorted(set(text))
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.searchsorted(np.array([ord(c) for c in chars], dtype=np.uint32), codepoints)
    return ids.astype(np.int64), chars


class CharDiffusionProvider(DataProviderBase):
    """Masked character windows: x corrupted, y the originals where masked, -100 elsewhere."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        block_size: int = 256,
        input: str | None = None,
        train_fraction: float = 0.9,
        stages: Sequence[Mapping[str, Any]] = DEFAULT_STAGES,
        remote: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ConfigError(
                f"char_diffusion: block_size must be a positive int, got {block_size!r}"
            )
        if not 0.0 < train_fraction < 1.0:
            raise ConfigError(
                f"char_diffusion: train_fraction must lie in (0, 1), got {train_fraction!r}"
            )
        self.block_size = block_size
        self.stages = parse_stages(stages)
        # Stage boundaries in batches: stage k covers [ends[k-1], ends[k]).
        self._ends = list(itertools.accumulate(s.batches or 0 for s in self.stages[:-1]))
        self._inputs: Sequence[Input]
        if input is None:
            (text, self._inputs), self.source = stdlib_corpus(), "python-stdlib"
            self._fixed = False
        else:
            # A path, or a URL (queue_providers.remote): read whole, through the input cache.
            store = store_for(remote, context.layout.input_cache_dir, "char_diffusion")
            path = resolve(input, store)
            if isinstance(path, Path) and not path.is_file():
                raise ConfigError(f"char_diffusion: input {str(path)!r} is not a file")
            text, self.source = read_text(path), shown(path)
            self._inputs = [path]
            self._fixed = isinstance(path, Path)  # not an object at a URL
        ids, self.chars = encode_chars(text)
        self.mask_id = len(self.chars)
        n_train = int(len(ids) * train_fraction)
        self.data = {
            "train": torch.from_numpy(ids[:n_train]),
            "val": torch.from_numpy(ids[n_train:]),
        }
        for split, data in self.data.items():
            if len(data) < block_size:
                raise ConfigError(
                    f"char_diffusion: the {split} split has {len(data)} characters, fewer than "
                    f"block_size={block_size}: use more text or a smaller block_size"
                )
        self._offsets = torch.arange(block_size)
        self._next_batch: dict[str, int] = {}

    def input_files(self) -> Sequence[Input]:
        """The text file, or the standard library files the default text was read from."""
        return list(self._inputs)

    def fixed_inputs(self) -> bool:
        """The text file a local path names (the standard library's files are a listing)."""
        return self._fixed

    def build_meta(self) -> dict[str, Any]:
        t = self.block_size
        itos: dict[int, str] = dict(enumerate(self.chars))
        itos[self.mask_id] = MASK_TOKEN
        return {
            "training_type": "MLM",
            "vocab_size": self.mask_id + 1,
            "block_size": t,
            "mask_token_id": self.mask_id,
            "ignore_index": IGNORE_INDEX,
            "stoi": {ch: i for i, ch in enumerate(self.chars)},
            "itos": itos,
            "stages": [s.to_dict() for s in self.stages],
            "source": self.source,
            # Stored as uint16 ids and int16 labels (-100 included) while the vocab allows.
            "batch_schema": [
                token_ids("x", [t], self.mask_id + 1),
                labels("y", [t], self.mask_id + 1, ignore=IGNORE_INDEX),
            ],
            "split_info": {split: {"tokens": len(d)} for split, d in self.data.items()},
        }

    # ---- sampling ------------------------------------------------------------------------------
    def stage_at(self, split: str, batch_index: int) -> Stage:
        """The stage of the batch at `batch_index` in the split's stream."""
        if split != "train":
            return self.stages[-1]
        return self.stages[bisect.bisect_right(self._ends, batch_index)]

    def clean_windows(self, split: str, rng: torch.Generator) -> torch.Tensor:
        data = self.data[split]
        starts = torch.randint(len(data) - self.block_size + 1, (self.batch_size, 1), generator=rng)
        return data[starts + self._offsets]

    def corrupt(
        self, clean: torch.Tensor, stage: Stage, rng: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Mask each position with its row's rate, drawn from the stage."""
        rows = clean.shape[0]
        rate = stage.lo + (stage.hi - stage.lo) * torch.rand(
            rows, 1, generator=rng, dtype=torch.float64
        )
        masked = torch.rand(clean.shape, generator=rng, dtype=torch.float64) < rate
        return {
            "x": torch.where(masked, self.mask_id, clean),
            "y": torch.where(masked, clean, IGNORE_INDEX),
        }

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        index = self._next_batch.get(split, 0)
        self._next_batch[split] = index + 1
        return self.corrupt(self.clean_windows(split, rng), self.stage_at(split, index), rng)

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        # The file's batches are positions seq*bpf .. seq*bpf+bpf-1 of the split's stream.
        self._next_batch[split] = seq * self.context.batches_per_file
        return super().make_file(split, seq)
