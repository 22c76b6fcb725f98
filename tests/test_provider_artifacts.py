"""The tokenized providers' array cache: built once, published whole under the dataset's
artifacts/<key>/ (layout.atomic_directory), and never half-visible."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from queue_client.errors import MetaError
from queue_client.format.layout import DatasetLayout
from queue_providers import ProviderContext
from queue_providers.tokenized.artifacts import cached_arrays, load_artifacts


class Builder:
    """A build function that counts its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("tokenizing failed")
        ids = np.arange(10, dtype=np.int32)
        return {"train_ids": ids, "val_ids": ids[::-1].copy()}, {"train": {"tokens": 10}}


def test_arrays_are_built_once_and_mapped_after(tmp_path: Path) -> None:
    layout = DatasetLayout(tmp_path, "ds")
    build = Builder()
    first, info = cached_arrays(layout, "k-1", build)
    again, info_again = cached_arrays(layout, "k-1", build)
    assert build.calls == 1 and info == info_again == {"train": {"tokens": 10}}
    assert np.array_equal(first["train_ids"], again["train_ids"])
    assert np.array_equal(again["val_ids"], np.arange(10)[::-1])
    assert isinstance(again["train_ids"], np.memmap) and not again["train_ids"].flags.writeable
    assert sorted(p.name for p in layout.artifacts_dir.iterdir()) == ["k-1"]
    assert sorted(p.name for p in layout.artifacts("k-1").iterdir()) == [
        "info.json",
        "train_ids.npy",
        "val_ids.npy",
    ]


def test_a_failed_build_publishes_nothing(tmp_path: Path) -> None:
    layout = DatasetLayout(tmp_path, "ds")
    with pytest.raises(RuntimeError, match="tokenizing failed"):
        cached_arrays(layout, "k-1", Builder(fail=True))
    assert not layout.artifacts("k-1").exists()
    assert not layout.artifacts_dir.exists() or not any(layout.artifacts_dir.iterdir())


def test_a_pinned_cache_that_is_gone_is_rebuilt_only_for_the_same_inputs(tmp_path: Path) -> None:
    layout = DatasetLayout(tmp_path, "ds")
    build = Builder()
    assert load_artifacts(layout, "k-1", None, build)[0] == "k-1"
    shutil.rmtree(layout.artifacts("k-1"))
    # The pinned key is what the inputs hash to now: the missing cache is simply built again.
    assert load_artifacts(layout, "k-1", "k-1", build)[0] == "k-1" and build.calls == 2
    with pytest.raises(MetaError, match="k-0 is gone and the inputs changed"):
        load_artifacts(layout, "k-1", "k-0", build)


def test_the_context_layout_names_the_dataset_dir(tmp_path: Path) -> None:
    ctx = ProviderContext("web", tmp_path / "web", batch_size=1)
    assert ctx.layout.artifacts("k-1") == tmp_path / "web" / "artifacts" / "k-1"
    assert ctx.layout.tokenizer_dir == tmp_path / "web" / "tokenizer"
