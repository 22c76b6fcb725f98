"""text_lm's corpus: the files of `source`, or those of a Hugging Face dataset (`hf_dataset`).

Either way the corpus is a list of SourceFile in canonical order, and val is either the first
eval_take documents of it (found by plan.find_boundary when meta is built), or, when
hf_splits maps val to a split of the dataset, every document of that split's files, which
come first (a Boundary fixed by the file count, so the two splits are disjoint by the files).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.remote import RemoteStore, is_url, redact
from queue_providers.text.files import SourceFile, discover
from queue_providers.text.plan import Boundary


@dataclass(frozen=True)
class Corpus:
    files: list[SourceFile]
    # How many leading files are the val split (hf_splits.val); None: val is eval_take of all.
    val_files: int | None
    # The source as errors name it (URLs without their secrets).
    shown: object
    # What meta["text_lm"]["hf"] records for a Hugging Face dataset; None for files.
    hf_info: dict[str, Any] | None = None

    def fixed_boundary(self) -> Boundary | None:
        """The first train document when val is a split of its own, else None."""
        return None if self.val_files is None else Boundary(self.val_files, 0)

    def split_info(self, eval_take: int) -> dict[str, Any]:
        """meta's split_info: where each split's documents come from."""
        if self.hf_info is not None and self.val_files is not None:
            mapped = self.hf_info["splits"]
            return {"train": {"hf_split": mapped["train"]}, "val": {"hf_split": mapped["val"]}}
        splits: dict[str, Any] = {"train": {"first_document": eval_take}}
        if eval_take:
            splits["val"] = {"first_document": 0, "documents": eval_take}
        return splits


def open_corpus(
    source: str | Sequence[str] | None,
    *,
    hf_dataset: str | None,
    hf_config: str | None,
    hf_revision: str | None,
    hf_splits: object,
    format: str,
    one_doc_per_file: bool,
    store: RemoteStore,
) -> Corpus:
    """The corpus a text_lm config names: ConfigError unless exactly one of source and
    hf_dataset is given, or when the hf_* keys come without hf_dataset."""
    if hf_dataset is None:
        if source is None:
            raise ConfigError(
                "text_lm needs `source` (files, folders, globs or URLs) or `hf_dataset` (a "
                "Hugging Face dataset: a save_to_disk directory, a folder of data files or a "
                "Hub name)"
            )
        extra = [k for k, v in (("hf_config", hf_config), ("hf_revision", hf_revision),
                                ("hf_splits", hf_splits)) if v is not None]  # fmt: skip
        if extra:
            raise ConfigError(f"text_lm {extra} apply to hf_dataset only, and there is none")
        files = discover(source, format=format, one_doc_per_file=one_doc_per_file, store=store)
        return Corpus(files, None, _shown(source))
    if source is not None:
        raise ConfigError("text_lm takes `source` or `hf_dataset`, not both")
    if format != "auto":
        raise ConfigError("text_lm format applies to `source` only: hf_dataset knows its format")
    from queue_providers.hf_source import open_hf_dataset

    hf = open_hf_dataset(
        hf_dataset, splits=hf_splits, config=hf_config, revision=hf_revision, store=store
    )
    return Corpus(hf.files, hf.val_files, hf_dataset, {"name": hf_dataset, **hf.info})


def _shown(source: str | Sequence[str]) -> object:
    if isinstance(source, str):
        return redact(source) if is_url(source) else source
    return [redact(s) if is_url(s) else s for s in source]
