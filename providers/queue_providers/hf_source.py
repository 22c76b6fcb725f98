"""Hugging Face datasets as a provider's input (text_lm, and the tokenized providers): which
files hold each split, in which format.

`hf_dataset` is one of
  - a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`: its Arrow
    files (listed in each split's state.json, in order) are memory-mapped and read row by row;
  - any other local directory of Parquet, JSONL or Arrow files: `datasets` decides which
    files make each split, exactly as `load_dataset(directory)` would (file names such as
    train-*.parquet, data/validation/..., or the configs of a README), then text_lm reads
    them itself;
  - a Hub dataset name ("org/name"): the same, over hf:// URLs, read as streams through
    queue_providers.remote (Parquet row groups and JSONL ranges as needed, never the whole
    dataset: what `streaming=True` gives, with text_lm's deterministic sharding).

`hf_splits` maps text_lm's splits to the dataset's: {"train": "train"} (the default) makes val
the first eval_take documents of that split, as for files; {"train": "train", "val":
"validation"} serves the dataset's own validation split as val. The files of the mapped splits
must differ, so train and val never share a document. Reading the files with text_lm's own
readers keeps every guarantee of a file source: documents in a canonical order, each in
exactly one worker's chunk, byte-identical replays. The dataset's fingerprint is its files:
local ones by sha256, Hub ones by their content hash (queue_providers.inputs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.remote import RemoteStore, is_url, local_path
from queue_providers.text.files import SourceFile, source_file

HF_EXTRA_HINT = "pip install 'batchqueue[hf]'"
DATASET_DICT_FILE = "dataset_dict.json"
STATE_FILE = "state.json"
SPLIT_KEYS = ("train", "val")
# The `datasets` builders whose files text_lm reads, and as which format.
BUILDER_FORMATS = {"parquet": "parquet", "json": "jsonl", "arrow": "arrow"}


def _hints(who: str) -> tuple[str, str]:
    """What a message offers `who` instead: its key for plain files, and how it takes val from
    train when hf_splits maps no val."""
    if who == "text_lm":
        return "`source`", "eval_take"
    return "`input`", "train_fraction"


@dataclass(frozen=True)
class HFCorpus:
    """The files of the mapped splits: val's first (when val is mapped), then train's."""

    files: list[SourceFile]
    val_files: int | None  # how many leading files are val; None: val is eval_take of train
    info: dict[str, Any] = field(default_factory=dict)  # what meta records about the source


def check_splits(splits: object, who: str = "text_lm") -> dict[str, str]:
    """hf_splits as {"train": NAME} or {"train": NAME, "val": NAME}, two different names."""
    if splits is None:
        return {"train": "train"}
    if not isinstance(splits, Mapping) or not all(
        isinstance(v, str) and v for v in splits.values()
    ):
        raise ConfigError(
            f"{who} hf_splits must be a table of {who} split to dataset split, such as "
            f'{{train = "train", val = "validation"}}, got {splits!r}'
        )
    unknown = sorted(set(splits) - set(SPLIT_KEYS))
    if unknown or "train" not in splits:
        raise ConfigError(
            f"{who} hf_splits maps {sorted(splits)}: it must map 'train', and may map 'val' "
            "(no other split names)"
        )
    if splits.get("val") == splits["train"]:
        raise ConfigError(
            f"{who} hf_splits maps train and val to the same split {splits['train']!r}: leave "
            + (
                "val out, and eval_take takes val from the front of train"
                if who == "text_lm"
                else f"val out, and {_hints(who)[1]} cuts val from train"
            )
        )
    return {k: str(splits[k]) for k in SPLIT_KEYS if k in splits}


def open_hf_dataset(
    name: str,
    *,
    splits: object = None,
    config: str | None = None,
    revision: str | None = None,
    store: RemoteStore | None = None,
    who: str = "text_lm",
) -> HFCorpus:
    """The corpus files of a Hugging Face dataset; ConfigError naming what is wrong. `who`
    (the provider) starts every message."""
    label = f"{who} hf_dataset"
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{label} must be a directory or a Hub dataset name, got {name!r}")
    mapping = check_splits(splits, who)
    if is_url(name):
        raise ConfigError(
            f"{label} {name!r} is a URL: give the files of a dataset at a URL as "
            f"{_hints(who)[0]} (a glob of Parquet or JSONL), or a Hub dataset by its name"
        )
    directory = local_path(name)
    if directory.is_dir():
        if (directory / DATASET_DICT_FILE).is_file() or (directory / STATE_FILE).is_file():
            by_split, info = _saved(directory, mapping, who)
        else:
            by_split, info = _data_files(str(directory), mapping, config, None, store, who)
    else:
        if "://" in name or name.startswith(("/", ".", "~")):
            raise ConfigError(f"{label} {name!r} is not a directory")
        by_split, info = _data_files(name, mapping, config, revision, store, who)
    train, val = by_split["train"], by_split.get("val")
    if val is not None:
        shared = {str(f.path) for f in train} & {str(f.path) for f in val}
        if shared:
            raise ConfigError(
                f"{label} {name!r}: splits {mapping['train']!r} and {mapping['val']!r} share "
                f"files {sorted(shared)[:3]}, so train and val would share documents"
            )
    files = [*(val or []), *train]
    return HFCorpus(files, None if val is None else len(val), info)


# ---- save_to_disk ---------------------------------------------------------------------------
def _saved(
    directory: Path, mapping: Mapping[str, str], who: str
) -> tuple[dict[str, list[SourceFile]], dict[str, Any]]:
    """A save_to_disk directory: a DatasetDict (dataset_dict.json, a folder per split) or one
    Dataset (state.json at the top: its one split, under any name the mapping gives it)."""
    dict_file = directory / DATASET_DICT_FILE
    if dict_file.is_file():
        available = _read_json(dict_file).get("splits")
        if not isinstance(available, list):
            raise ConfigError(f"{dict_file}: no 'splits' list; is it a save_to_disk directory?")
        split_dirs = {}
        for ours, theirs in mapping.items():
            if theirs not in available:
                raise ConfigError(
                    f"{who} hf_dataset {str(directory)!r} has no split {theirs!r} "
                    f"(hf_splits.{ours}); it "
                    f"has {available}"
                )
            split_dirs[ours] = directory / theirs
    else:
        if "val" in mapping:
            raise ConfigError(
                f"{who} hf_dataset {str(directory)!r} holds one Dataset, not a DatasetDict, so "
                "it has no second split for val: leave hf_splits.val out (val is then "
                f"{_hints(who)[1]} of it)"
            )
        split_dirs = {"train": directory}
    by_split: dict[str, list[SourceFile]] = {}
    fingerprints: dict[str, Any] = {}
    for ours, split_dir in split_dirs.items():
        state = _read_json(split_dir / STATE_FILE)
        entries = state.get("_data_files")
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{split_dir / STATE_FILE}: no '_data_files' list of Arrow files")
        files = []
        for entry in entries:
            filename = entry.get("filename") if isinstance(entry, Mapping) else None
            if not isinstance(filename, str) or "/" in filename or filename.startswith("."):
                raise ConfigError(f"{split_dir / STATE_FILE}: a data file entry {entry!r} is bad")
            path = split_dir / filename
            if not path.is_file():
                raise ConfigError(f"{path} is listed in {STATE_FILE} but missing")
            files.append(source_file(path.resolve(), "arrow", one_doc_per_file=False))
        by_split[ours] = files
        fingerprints[ours] = state.get("_fingerprint")
    info = {"kind": "save_to_disk", "splits": dict(mapping), "fingerprints": fingerprints}
    return by_split, info


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a {type(value).__name__}, expected a JSON object")
    return value


# ---- data files (a local folder or the Hub) -----------------------------------------------
def _datasets(who: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{who} hf_dataset names a folder of data files or a Hub dataset, which needs the "
            f"`datasets` package to find each split's files: {HF_EXTRA_HINT}"
        ) from None
    return datasets


def _data_files(
    name: str,
    mapping: Mapping[str, str],
    config: str | None,
    revision: str | None,
    store: RemoteStore | None,
    who: str,
) -> tuple[dict[str, list[SourceFile]], dict[str, Any]]:
    datasets = _datasets(who)
    label = f"{who} hf_dataset"
    hub = not Path(name).is_dir()
    if hub:
        revision = _hub_revision(name, revision, who)
    try:
        builder = datasets.load_dataset_builder(name, config, revision=revision)
    except Exception as exc:
        raise ConfigError(
            f"{label} {name!r} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from None
    fmt = BUILDER_FORMATS.get(str(builder.name))
    if fmt is None:
        raise ConfigError(
            f"{label} {name!r} is a {builder.name!r} dataset; {who} reads the files of "
            f"{sorted(BUILDER_FORMATS)} datasets"
            + (" (for text files use `source` with a separator)" if who == "text_lm" else "")
        )
    available = {str(k): list(v) for k, v in (builder.config.data_files or {}).items()}
    by_split = {}
    for ours, theirs in mapping.items():
        if theirs not in available:
            raise ConfigError(
                f"{label} {name!r} has no split {theirs!r} (hf_splits.{ours}); it has "
                f"{sorted(available)}"
            )
        by_split[ours] = _files(available[theirs], fmt, hub, store, who)
    info = {
        "kind": "hub" if hub else "data_files",
        "builder": str(builder.name),
        "config": builder.config.name,
        "splits": dict(mapping),
    }
    if hub:
        info["revision"] = revision
    return by_split, info


def _files(
    names: Sequence[str], fmt: str, hub: bool, store: RemoteStore | None, who: str
) -> list[SourceFile]:
    if not hub:
        return [source_file(Path(n).resolve(), fmt, one_doc_per_file=False) for n in sorted(names)]
    if fmt == "arrow":
        raise ConfigError(
            f"{who} hf_dataset: the Hub dataset's files are Arrow, which {who} memory-maps "
            "from local disk only: save it with save_to_disk and give that directory"
        )
    store = store or RemoteStore()
    return [source_file(store.stat(n), fmt, one_doc_per_file=False) for n in sorted(names)]


def _hub_revision(name: str, revision: str | None, who: str) -> str:
    """The commit `revision` (default: main) of Hub dataset `name` is at: asked once, with a
    short timeout, so an offline machine fails at once with a clear message."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError(
            f"{who} hf_dataset {name!r} names a Hub dataset: {HF_EXTRA_HINT}"
        ) from None
    try:
        info = HfApi().dataset_info(name, revision=revision, timeout=10)
    except Exception as exc:
        kind = type(exc).__name__
        if "NotFound" in kind:
            why = "the Hub has no such dataset (a private one needs HF_TOKEN in the environment)"
        elif "Offline" in kind:
            why = "the Hub is switched off here (HF_HUB_OFFLINE is set)"
        else:
            why = f"the Hub cannot be reached ({kind}: {str(exc)[:200]})"
        raise ConfigError(
            f"{who} hf_dataset {name!r} is not a local directory, so it names a Hugging Face "
            f"Hub dataset, and {why}. Without the Hub, give a local copy: a directory written by "
            "save_to_disk, or a folder of Parquet or JSONL files"
        ) from None
    return str(info.sha)
