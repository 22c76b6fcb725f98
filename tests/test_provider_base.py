"""DataProviderBase, the provider registry, and the char_lm provider, with no server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from queue_client.errors import ConfigError, MetaError, SchemaMismatch
from queue_client.format.batchfile import load_batch_file, scan_queue
from queue_client.format.meta import validate_meta
from queue_providers import registry
from queue_providers.base import DataProviderBase, ProviderContext, derive_seed
from queue_providers.char_lm import CharLMProvider


class ToyProvider(DataProviderBase):
    """Random ints in [0, 1000): a stateless provider whose output depends only on the RNG."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        width: int = 3,
        dtype: torch.dtype = torch.int64,
        meta_overrides: dict[str, Any] | None = None,
        drop_keys: tuple[str, ...] = (),
    ) -> None:
        super().__init__(context)
        self.width = width
        self.dtype = dtype
        self.meta_overrides = meta_overrides or {}
        self.drop_keys = drop_keys

    def build_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "training_type": "SEQUENCE_SCORING",
            "batch_schema": [{"name": "x", "dtype": "int64", "shape": [self.width]}],
            "split_info": {"train": {}, "val": {}},
        }
        meta.update(self.meta_overrides)
        for key in self.drop_keys:
            meta.pop(key, None)
        return meta

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 1000, (self.batch_size, self.width), generator=rng)
        return {"x": x.to(self.dtype)}


class NeedsArg(DataProviderBase):
    """A provider with a required keyword-only argument."""

    def __init__(self, context: ProviderContext, *, path: str, limit: int = 1) -> None:
        super().__init__(context)

    def build_meta(self) -> dict[str, Any]:
        return {}

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        return {}


class NotAProvider:
    """Has the right shape of name but is no DataProviderBase."""


def _context(tmp_path: Path, **kw: Any) -> ProviderContext:
    kw.setdefault("batch_size", 4)
    kw.setdefault("batches_per_file", 3)
    return ProviderContext(dataset_name="toy", dataset_dir=tmp_path, **kw)


def _ready(provider: DataProviderBase) -> DataProviderBase:
    provider.set_meta(provider.complete_meta())
    return provider


def _produce(
    provider: DataProviderBase, split: str, seq: int, directory: Path
) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    published = provider.produce_file(split, seq, directory)
    return load_batch_file(directory / str(published.name)).tensors


# ---- DataProviderBase ---------------------------------------------------------------------


def test_produce_file_is_deterministic_in_seed_split_seq(tmp_path: Path) -> None:
    """The same (seed, split, seq) gives identical tensors, even from another instance
    and after other files were produced in between."""
    a = _ready(ToyProvider(_context(tmp_path)))
    b = _ready(ToyProvider(_context(tmp_path)))
    first = _produce(a, "train", 5, tmp_path / "a")
    _produce(b, "train", 1, tmp_path / "b")
    _produce(b, "val", 5, tmp_path / "b")
    second = _produce(b, "train", 5, tmp_path / "c")
    assert torch.equal(first["x"], second["x"])
    again = _produce(a, "train", 5, tmp_path / "d")
    assert torch.equal(first["x"], again["x"])


def test_produce_file_differs_by_seq_split_and_seed(tmp_path: Path) -> None:
    """Another seq, split or seed gives different data."""
    base = _produce(_ready(ToyProvider(_context(tmp_path))), "train", 5, tmp_path / "base")["x"]
    other_seq = _produce(_ready(ToyProvider(_context(tmp_path))), "train", 6, tmp_path / "seq")["x"]
    other_split = _produce(_ready(ToyProvider(_context(tmp_path))), "val", 5, tmp_path / "split")[
        "x"
    ]
    other_seed = _produce(
        _ready(ToyProvider(_context(tmp_path, seed=1))), "train", 5, tmp_path / "seed"
    )["x"]
    for other in (other_seq, other_split, other_seed):
        assert not torch.equal(base, other)


def test_produce_file_shape_and_metadata(tmp_path: Path) -> None:
    """A file holds [batches_per_file, batch_size, *shape] and records dataset, split, schema."""
    provider = _ready(ToyProvider(_context(tmp_path, batch_size=2, batches_per_file=5), width=7))
    (tmp_path / "q").mkdir()
    published = provider.produce_file("val", 9, tmp_path / "q")
    assert published.name.seq == 9
    assert published.name.num_batches == 5
    loaded = load_batch_file(tmp_path / "q" / str(published.name))
    assert loaded.tensors["x"].shape == (5, 2, 7)
    assert loaded.tensors["x"].dtype == torch.int64
    md = loaded.metadata
    assert (md["dataset"], md["split"], md["batch_size"], md["seq"]) == ("toy", "val", 2, 9)
    assert md["schema"] == [{"name": "x", "dtype": "int64", "shape": [7], "role": ""}]
    # The batches within a file are not all the same batch.
    assert not torch.equal(loaded.tensors["x"][0], loaded.tensors["x"][1])


def test_produce_file_before_set_meta_or_unknown_split(tmp_path: Path) -> None:
    """Producing for a split the meta does not declare raises MetaError naming it."""
    provider = ToyProvider(_context(tmp_path))
    with pytest.raises(MetaError, match="'train'"):
        provider.produce_file("train", 0, tmp_path)
    _ready(provider)
    with pytest.raises(MetaError, match="'test'"):
        provider.produce_file("test", 0, tmp_path)


def test_complete_meta_fills_base_keys(tmp_path: Path) -> None:
    """complete_meta adds dataset_name, batch_size, batches_per_file and extra_meta, and validates."""
    ctx = _context(tmp_path, batch_size=6, batches_per_file=11, extra_meta={"fingerprint": "abc"})
    meta = ToyProvider(ctx).complete_meta()
    assert meta["dataset_name"] == "toy"
    assert meta["batch_size"] == 6
    assert meta["batches_per_file"] == 11
    assert meta["fingerprint"] == "abc"
    validate_meta(meta)


def test_complete_meta_accepts_agreeing_base_keys(tmp_path: Path) -> None:
    """build_meta may set dataset_name and batch_size if they agree with the config."""
    provider = ToyProvider(
        _context(tmp_path), meta_overrides={"dataset_name": "toy", "batch_size": 4}
    )
    assert provider.complete_meta()["batch_size"] == 4


def test_complete_meta_names_missing_keys(tmp_path: Path) -> None:
    """A build_meta lacking required keys raises MetaError naming each of them."""
    provider = ToyProvider(_context(tmp_path), drop_keys=("batch_schema", "split_info"))
    with pytest.raises(MetaError) as info:
        provider.complete_meta()
    message = str(info.value)
    assert "'batch_schema'" in message and "'split_info'" in message
    assert "ToyProvider" in message


def test_complete_meta_names_keys_required_by_training_type(tmp_path: Path) -> None:
    """Switching to LM without vocab_size/block_size names both."""
    provider = ToyProvider(_context(tmp_path), meta_overrides={"training_type": "LM"})
    with pytest.raises(MetaError) as info:
        provider.complete_meta()
    assert "'vocab_size'" in str(info.value) and "'block_size'" in str(info.value)


@pytest.mark.parametrize(("key", "value"), [("batch_size", 8), ("dataset_name", "other")])
def test_complete_meta_refuses_conflicting_base_key(
    tmp_path: Path, key: str, value: object
) -> None:
    """build_meta disagreeing with the config on a base-owned key raises naming it and both values."""
    provider = ToyProvider(_context(tmp_path), meta_overrides={key: value})
    with pytest.raises(MetaError, match=key) as info:
        provider.complete_meta()
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_wrong_dtype_from_sample_batch_is_schema_mismatch(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """A sample_batch returning the wrong dtype fails produce_file naming the field; no file is published."""
    provider = _ready(ToyProvider(_context(tmp_path), dtype=dtype))
    (tmp_path / "q").mkdir()
    with pytest.raises(SchemaMismatch, match="'x'"):
        provider.produce_file("train", 0, tmp_path / "q")
    assert scan_queue(tmp_path / "q") == []


def test_stateless_provider_refuses_state(tmp_path: Path) -> None:
    """A stateless provider has an empty state and refuses a non-empty one."""
    provider = ToyProvider(_context(tmp_path))
    assert provider.state_dict("train") == {}
    provider.load_state_dict("train", {})
    with pytest.raises(ValueError, match="stateless"):
        provider.load_state_dict("train", {"pos": 3})


def test_derive_seed_is_stable_and_distinct() -> None:
    """derive_seed is a pure 63-bit function of its inputs."""
    assert derive_seed(1, "train", 0) == derive_seed(1, "train", 0)
    seeds = {
        derive_seed(s, split, q) for s in (0, 1) for split in ("train", "val") for q in range(5)
    }
    assert len(seeds) == 20
    assert all(0 <= s < 2**63 for s in seeds)


# ---- registry -----------------------------------------------------------------------------


def test_resolve_builtin_and_dotted_names() -> None:
    """Built-in names and 'module:Class' targets resolve to provider classes."""
    assert registry.resolve("char_lm") is CharLMProvider
    assert registry.resolve("queue_providers.char_lm:CharLMProvider") is CharLMProvider
    assert registry.resolve(f"{__name__}:ToyProvider") is ToyProvider


@pytest.mark.parametrize(
    "name",
    [
        "no_such_provider",
        "",
        "no_such_module_xyz:Thing",
        "queue_providers.char_lm:NoSuchClass",
        "queue_client.errors:MetaError",
        "queue_providers.char_lm:stdlib_text",
        f"{__name__}:NotAProvider",
    ],
)
def test_resolve_refuses_unknown_and_non_provider(name: str) -> None:
    """Unknown names, missing modules/classes and non-provider objects raise ConfigError naming it."""
    with pytest.raises(ConfigError) as info:
        registry.resolve(name)
    assert repr(name) in str(info.value)


def test_create_refuses_unknown_arg(tmp_path: Path) -> None:
    """An args key the provider does not accept raises ConfigError naming it and the dataset."""
    with pytest.raises(ConfigError) as info:
        registry.create("char_lm", _context(tmp_path), {"block_size": 8, "blok_size": 8})
    message = str(info.value)
    assert "'blok_size'" in message
    assert "datasets.toy.args" in message


def test_create_refuses_missing_required_arg(tmp_path: Path) -> None:
    """A required keyword-only argument left out raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="'path'") as info:
        registry.create(f"{__name__}:NeedsArg", _context(tmp_path), {"limit": 2})
    assert "missing" in str(info.value)


def test_create_builds_provider_with_args(tmp_path: Path) -> None:
    """create passes args through as keyword arguments."""
    provider = registry.create(f"{__name__}:ToyProvider", _context(tmp_path), {"width": 9})
    assert isinstance(provider, ToyProvider)
    assert provider.width == 9


# ---- char_lm ------------------------------------------------------------------------------

TEXT = (
    "the quick brown fox jumps over the lazy dog; PACK MY BOX WITH FIVE DOZEN JUGS! \u00e9\U0001f600\n"
    * 6
)


def _char_lm(tmp_path: Path, text: str = TEXT, **args: Any) -> CharLMProvider:
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    args.setdefault("block_size", 8)
    return CharLMProvider(
        _context(tmp_path, batch_size=5, batches_per_file=4), input=str(path), **args
    )


def test_char_lm_meta_matches_text(tmp_path: Path) -> None:
    """vocab_size, stoi and itos describe exactly the text's characters, sorted."""
    provider = _char_lm(tmp_path)
    meta = provider.complete_meta()
    chars = sorted(set(TEXT))
    assert meta["vocab_size"] == len(chars)
    assert meta["itos"] == dict(enumerate(chars))
    assert meta["stoi"] == {c: i for i, c in enumerate(chars)}
    assert meta["block_size"] == 8
    assert meta["training_type"] == "LM"
    assert meta["source"] == str(tmp_path / "input.txt")
    ids = np.concatenate([provider.data["train"], provider.data["val"]])
    assert ids.dtype == np.int64
    assert ids.tolist() == [meta["stoi"][c] for c in TEXT]


def test_char_lm_batches_are_shifted_windows_of_the_text(tmp_path: Path) -> None:
    """y is x shifted by one, and every window decodes to a substring of its split's text."""
    provider = _ready(_char_lm(tmp_path))
    itos = provider.itos
    n_train = int(len(TEXT) * 0.9)
    for split, source in (("train", TEXT[:n_train]), ("val", TEXT[n_train:])):
        tensors = _produce(provider, split, 0, tmp_path / split)
        x, y = tensors["x"], tensors["y"]
        assert x.shape == y.shape == (4, 5, 8)
        assert torch.equal(x[..., 1:], y[..., :-1])
        for xs, ys in zip(x.reshape(-1, 8).tolist(), y.reshape(-1, 8).tolist(), strict=True):
            window = "".join(itos[i] for i in xs) + itos[ys[-1]]
            assert window in source


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.75])
def test_char_lm_split_sizes_follow_train_fraction(tmp_path: Path, fraction: float) -> None:
    """The first train_fraction of the text is train, the rest val."""
    meta = _char_lm(tmp_path, train_fraction=fraction).complete_meta()
    n_train = int(len(TEXT) * fraction)
    assert meta["split_info"]["train"]["tokens"] == n_train
    assert meta["split_info"]["val"]["tokens"] == len(TEXT) - n_train


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_char_lm_rejects_bad_train_fraction(tmp_path: Path, fraction: float) -> None:
    """train_fraction outside (0, 1) raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="train_fraction"):
        _char_lm(tmp_path, train_fraction=fraction)


@pytest.mark.parametrize("block_size", [0, -1, 2.5, "8"])
def test_char_lm_rejects_bad_block_size(tmp_path: Path, block_size: object) -> None:
    """block_size must be a positive int."""
    with pytest.raises(ConfigError, match="block_size"):
        _char_lm(tmp_path, block_size=block_size)


def test_char_lm_too_short_text_names_block_size(tmp_path: Path) -> None:
    """A text too short for one window raises ConfigError naming block_size."""
    with pytest.raises(ConfigError, match="block_size"):
        _char_lm(tmp_path, text="abcdefghij" * 3, block_size=8)


def test_char_lm_missing_input_names_path(tmp_path: Path) -> None:
    """A missing input file raises ConfigError naming the path."""
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ConfigError) as info:
        CharLMProvider(_context(tmp_path), input=str(missing))
    assert str(missing) in str(info.value)


def test_char_lm_default_text_is_stdlib_and_deterministic(tmp_path: Path) -> None:
    """With no input, the text is Python's standard library: non-empty and the same every time."""
    a = CharLMProvider(_context(tmp_path), block_size=16)
    b = CharLMProvider(_context(tmp_path), block_size=16)
    assert a.source == b.source == "python-stdlib"
    assert len(a.data["train"]) > 0 and len(a.data["val"]) > 0
    assert a.itos == b.itos
    assert np.array_equal(a.data["train"], b.data["train"])
    assert np.array_equal(a.data["val"], b.data["val"])
    assert torch.equal(
        _produce(_ready(a), "train", 3, tmp_path / "a")["x"],
        _produce(_ready(b), "train", 3, tmp_path / "b")["x"],
    )
