"""A Hugging Face dataset as a tokenized provider's input: the named columns of its rows.

hf_source finds the files of each mapped split (a save_to_disk directory, a folder of Parquet,
JSONL or Arrow files, or a Hub name); this module reads the columns a provider names from
those files with pyarrow, in the dataset's canonical order (files in order, rows in order), so
the same rows give the same items however often they are read. Each column's type is checked
once per file, so a wrong column is one error naming the key, the dataset and what was found,
not a bad row later. Only data files are read: no loading script ever runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from queue_client.errors import ConfigError
from queue_providers.remote import RemoteObject, RemoteStore, local_files, shown
from queue_providers.text.files import SourceFile, arrow_table

# What a column may hold, by kind: a test on its Arrow type, and the words errors use.
TEXT, LABEL, WORDS, TAGS = "text", "label", "words", "tags"
KIND_WORDS = {
    TEXT: "strings",
    LABEL: "integers or strings",
    WORDS: "lists of strings",
    TAGS: "lists of integers or strings",
}


def _type_fits(kind: str, arrow_type: Any) -> bool:
    import pyarrow.types as pt

    def scalar(t: Any, ints: bool) -> bool:
        return bool(pt.is_string(t) or pt.is_large_string(t) or (ints and pt.is_integer(t)))

    if kind in (TEXT, LABEL):
        return scalar(arrow_type, ints=kind == LABEL)
    is_list = pt.is_list(arrow_type) or pt.is_large_list(arrow_type)
    return bool(is_list and scalar(arrow_type.value_type, ints=kind == TAGS))


@dataclass(frozen=True)
class Column:
    """A column a provider reads: the config key that names it, its name, and its kind."""

    key: str
    name: str
    kind: str


@dataclass(frozen=True)
class HFRows:
    """The files of each mapped split of one dataset ("train", and "val" when mapped)."""

    who: str
    name: str
    splits: dict[str, str]  # provider split -> the dataset's split
    files: dict[str, list[SourceFile]]
    info: dict[str, Any]

    @property
    def has_val(self) -> bool:
        return "val" in self.files

    def locations(self) -> list[Any]:
        """Every file of the mapped splits: the provider's inputs, fingerprinted by content."""
        return [f.path for split in sorted(self.files) for f in self.files[split]]

    def identity(self) -> tuple[object, ...]:
        """What the cache key takes of the dataset: its name, splits and files' identities."""
        return (self.name, tuple(sorted(self.splits.items())), [
            (split, [_file_identity(f) for f in self.files[split]]) for split in sorted(self.files)
        ])  # fmt: skip

    def where(self, split: str, row: int) -> str:
        """A row as errors name it."""
        return f"{self.who} hf_dataset {self.name!r} split {self.splits[split]!r} row {row}"

    def read(self, split: str, columns: Sequence[Column]) -> dict[str, list[Any]]:
        """The values of `columns` (by config key) over every row of `split`, in order."""
        values: dict[str, list[Any]] = {c.key: [] for c in columns}
        first_row = 0
        for f in self.files[split]:
            table = _table(f, columns, self, split)
            for c in columns:
                column = table.column(c.name)
                self._check(split, f, c, column, first_row)
                values[c.key].extend(column.to_pylist())
            first_row += table.num_rows
        return values

    def _check(self, split: str, f: SourceFile, c: Column, column: Any, first_row: int) -> None:
        import pyarrow.compute as pc

        if not _type_fits(c.kind, column.type):
            raise ConfigError(
                f"{self.who}: {c.key} {c.name!r} of hf_dataset {self.name!r} split "
                f"{self.splits[split]!r} holds {column.type} ({shown(f.path)}); it must hold "
                f"{KIND_WORDS[c.kind]}"
            )
        nulls = column.is_null()
        if c.kind in (WORDS, TAGS) and column.null_count == 0:
            flat = pc.list_flatten(column)
            if flat.null_count:  # a null inside a list: name its row (one chunk, so the
                # parent indices count rows of the whole column)
                parents = np.asarray(pc.list_parent_indices(column.combine_chunks()))
                nulls = np.zeros(len(column), dtype=bool)
                nulls[parents[np.asarray(flat.is_null())]] = True
        bad = np.flatnonzero(np.asarray(nulls))
        if len(bad):
            raise ConfigError(
                f"{self.where(split, first_row + int(bad[0]))}: {c.key} {c.name!r} is null "
                f"({len(bad)} row(s) of {shown(f.path)} hold a null)"
            )


def _file_identity(f: SourceFile) -> tuple[object, ...]:
    if isinstance(f.path, RemoteObject):
        return (f.path.shown, f.path.size, f.path.identity)
    st = f.path.stat()
    return (str(f.path), st.st_size, st.st_mtime_ns)


def _table(f: SourceFile, columns: Sequence[Column], rows: HFRows, split: str) -> Any:
    """The `columns` of one file as a pyarrow Table; ConfigError naming a missing one."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    try:
        if f.format == "arrow":
            table = arrow_table(f.path)
        elif f.format == "parquet":
            with local_files([f.path]) as (path,):
                table = pq.read_table(path)
        elif f.format == "jsonl":
            # A block must hold a whole line: the file's size, so no row is too long to read.
            block = max(1 << 20, min(f.size + 1, (1 << 31) - 1))
            with local_files([f.path]) as (path,):
                table = pj.read_json(path, read_options=pj.ReadOptions(block_size=block))
        else:  # hf_source gives only these three
            raise ConfigError(f"{shown(f.path)}: {rows.who} cannot read {f.format!r} files")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{rows.who} hf_dataset {rows.name!r}: {shown(f.path)} cannot be read as "
            f"{f.format}: {type(exc).__name__}: {exc}"
        ) from None
    missing = [c for c in columns if c.name not in table.column_names]
    if missing:
        raise ConfigError(
            f"{rows.who}: hf_dataset {rows.name!r} split {rows.splits[split]!r} has no column "
            + ", ".join(f"{c.name!r} ({c.key})" for c in missing)
            + f"; its columns are {table.column_names}"
        )
    return table.select(list(dict.fromkeys(c.name for c in columns)))


def open_hf_rows(
    who: str,
    *,
    hf_dataset: str,
    hf_splits: object,
    hf_config: str | None,
    hf_revision: str | None,
    store: RemoteStore,
) -> HFRows:
    """The mapped splits of `hf_dataset` (hf_source.open_hf_dataset), for `who`."""
    from queue_providers.hf_source import check_splits, open_hf_dataset

    corpus = open_hf_dataset(
        hf_dataset, splits=hf_splits, config=hf_config, revision=hf_revision, store=store, who=who
    )
    mapping = check_splits(hf_splits, who)
    n_val = corpus.val_files or 0
    files = {"train": corpus.files[n_val:]}
    if corpus.val_files is not None:
        files["val"] = corpus.files[:n_val]
    return HFRows(who, hf_dataset, mapping, files, {"name": hf_dataset, **corpus.info})


def column_names(
    who: str,
    hf_dataset: str | None,
    given: dict[str, str | None],
    defaults: dict[str, str],
) -> dict[str, str]:
    """The column each key names (given, else its default). A key given without hf_dataset is
    a ConfigError: it would silently do nothing."""
    unused = [k for k, v in given.items() if v is not None]
    if hf_dataset is None and unused:
        raise ConfigError(f"{who}: {unused} name columns of hf_dataset, and there is none")
    names = {k: defaults[k] if v is None else v for k, v in given.items()}
    for key, name in names.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{who}: {key} must be a column name (a string), got {name!r}")
    return names
