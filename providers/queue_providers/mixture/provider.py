"""MixtureProvider: file seq s holds rows [s*R, (s+1)*R) of the split's row stream, each
drawn from the source the row schedule (queue_client/mixture.py) assigns to it.

The weights in force at each seq come from the config (weights, then `mixture_schedule`
points over served tokens) and from SetMixture calls, which the server journals and sends
with every produce (set_weight_changes). A file is a pure function of (config, seed, split,
seq, the calls whose seq is <= s): any worker, process or machine makes the same bytes.

With a streaming source (text_lm) the mixture streams too: its state, journaled with each
file, holds each streaming source's place in its own stream (rows.py), so a file made again
or a restarted worker makes the same bytes. The file names each source epoch whose first row
it holds (EncodedBatchFile.epoch_starts): the process that publishes it records and logs
them (queue_server/mixture/epochs.py), on the data root's machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.errors import ConfigError, MetaError
from queue_client.format.batchfile import EncodedBatchFile, encode_batch_file
from queue_client.format.batchfile_v3 import NUMPY_DTYPES
from queue_client.format.meta import split_schema, token_field
from queue_client.format.schema import NEXT_TOKEN, PLAIN, WINDOW, FieldSpec, check_tensors
from queue_client.format.storage_encode import encode_stored
from queue_client.mixture import RowSchedule, ScheduleCache, WeightPlan
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.mixture.rows import SourceRows, source_rows
from queue_providers.mixture.sources import build_sources, check_same_schema, source_meta
from queue_providers.mixture.tokenizers import check_one_tokenizer
from queue_providers.provenance import check_rows
from queue_providers.token_ids import check_ids

if TYPE_CHECKING:
    import torch

SOURCE_FIELD = "source"
# Stored kinds whose stored rows are what encoding the served rows again would store: a file
# of them is made by copying the sources' stored rows (no decoding, no torch).
_ROW_COPY_KINDS = frozenset({PLAIN, WINDOW, NEXT_TOKEN})
STATE_VERSION = 1
STATE_KEYS = frozenset({"version", "sources"})


def source_field() -> dict[str, Any]:
    return {
        "name": SOURCE_FIELD,
        "dtype": "int64",
        "shape": [],
        "role": "",
        "stored_dtype": "uint8",
    }


class MixtureProvider(DataProviderBase):
    def __init__(
        self,
        context: ProviderContext,
        *,
        sources: Sequence[Mapping[str, Any]],
        schedule: Sequence[Sequence[Any]] = (),
        schedule_unit: str = "tokens",
    ) -> None:
        super().__init__(context)
        if not sources or len(sources) > 255:
            raise ConfigError(f"datasets.{context.dataset_name}: a mixture needs 1 to 255 sources")
        self.names = [str(s["name"]) for s in sources]
        self.weights = [float(s["weight"]) for s in sources]
        self.schedule = [(float(x), [float(w) for w in ws]) for x, ws in schedule]
        self.schedule_unit = schedule_unit
        self._providers = build_sources(context, sources)
        check_one_tokenizer(self.names, self._providers, f"datasets.{context.dataset_name}.sources")
        self._rows = [source_rows(p, n) for p, n in zip(self._providers, self.names, strict=True)]
        self._changes: dict[str, list] = {}
        self._schedules = ScheduleCache()
        self._tokens_per_row: dict[str, int] = {}  # by split: the token field's positions

    @property
    def rows_per_file(self) -> int:
        return self.batch_size * self.context.batches_per_file

    # ---- meta ---------------------------------------------------------------------------
    def input_files(self):  # type: ignore[no-untyped-def]
        return [f for p in self._providers for f in p.input_files()]

    def build_meta(self) -> dict[str, Any]:
        where = f"datasets.{self.context.dataset_name}.sources"
        metas = [source_meta(p, self.context) for p in self._providers]
        check_same_schema(self.names, metas, where)
        meta = {k: v for k, v in metas[0].items() if k not in ("source", "batch_format_version")}
        for name in ("batch_size", "batches_per_file", "dataset_name"):
            meta.pop(name, None)
        if any(
            f.name == SOURCE_FIELD for f in split_schema(metas[0], next(iter(meta["split_info"])))
        ):
            raise ConfigError(f"{where}: the sources' batches have a field named {SOURCE_FIELD!r}")
        meta["batch_schema"] = [*metas[0]["batch_schema"], source_field()]
        meta["split_info"] = {}
        for split, info in metas[0]["split_info"].items():
            info = dict(info) if isinstance(info, dict) else {}
            if "batch_schema" in info:
                info["batch_schema"] = [*info["batch_schema"], source_field()]
            meta["split_info"][split] = info
        meta["mixture"] = {
            "sources": list(self.names),
            "weights": list(self.weights),
            "source_field": SOURCE_FIELD,
            "source_meta": metas,
            # Whether each source's data has epochs whose starts are recorded for stats.
            "ordered_epochs": [bool(p.ordered_epochs) for p in self._providers],
        }
        return meta

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        for provider, sub in zip(self._providers, meta["mixture"]["source_meta"], strict=True):
            provider.set_meta(sub)
        # A schedule point's tokens count each row's token field: x's block_size, or
        # text_lm's micro_batch_size x seq_len (the server's stats count the same).
        self._tokens_per_row = {s: max(1, token_field(meta, s)[1]) for s in meta["split_info"]}
        # The sources' streams start over with their meta: so does the bookkeeping of them.
        self._rows = [source_rows(p, n) for p, n in zip(self._providers, self.names, strict=True)]

    # ---- state (with a streaming source) --------------------------------------------------
    @property
    def streams(self) -> bool:
        return any(p.streams for p in self._providers)

    def state_dict(self, split: str) -> dict[str, Any]:
        """Each streaming source's place in its own stream; empty when none streams."""
        if not self.streams:
            return {}
        sources = {r.name: r.state(split) for r in self._rows if r.provider.streams}
        return {"version": STATE_VERSION, "sources": sources}

    def load_state_dict(self, split: str, state: Mapping[str, Any]) -> None:
        if not self.streams:
            super().load_state_dict(split, state)
            return
        where = f"mixture {self.context.dataset_name!r} split {split!r} state"
        if set(state) != STATE_KEYS or state["version"] != STATE_VERSION:
            raise ValueError(
                f"{where} has keys {sorted(state)} (version {state.get('version')!r}), "
                f"expected {sorted(STATE_KEYS)} of version {STATE_VERSION}"
            )
        streaming = [r for r in self._rows if r.provider.streams]
        if sorted(state["sources"]) != sorted(r.name for r in streaming):
            raise ValueError(
                f"{where} holds sources {sorted(state['sources'])}, but the streaming sources "
                f"are {sorted(r.name for r in streaming)}: the config's sources changed"
            )
        for rows in streaming:
            rows.load(split, state["sources"][rows.name])

    # ---- weights ------------------------------------------------------------------------
    def plan(self, split: str = "") -> WeightPlan:
        return WeightPlan(
            tuple(self.names),
            tuple(self.weights),
            tuple((int(x), tuple(w)) for x, w in self.schedule),
            self.rows_per_file,
            self._tokens_per_row.get(split, 1),
        )

    def set_weight_changes(self, split: str, changes: Sequence[Sequence[Any]]) -> None:
        """The journaled SetMixture calls of `split`, in call order: [first seq, {name: weight}
        or None for "back to the config"]."""
        self._changes[split] = self.plan().by_name([(int(at), w) for at, w in changes])

    def row_schedule(self, split: str) -> RowSchedule:
        return self._schedules.get(self.plan(split).segments(self._changes.get(split, [])))

    # ---- files --------------------------------------------------------------------------
    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a mixture makes whole files (make_file), not single batches")

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        schema = self._schemas.get(split)
        if schema is None:
            raise MetaError(f"split {split!r} is not in meta split_info {sorted(self._schemas)}")
        per_file, b = self.rows_per_file, self.batch_size
        schedule = self.row_schedule(split)
        first = seq * per_file
        picks = np.array(schedule.sources_of(first, first + per_file), dtype=np.int64)
        before = schedule.counts(first)
        tensors: Mapping[str, Any]
        if self.copies_stored_rows(split):
            tensors, starts = self._stored_file(split, seq, picks, before)
        else:
            tensors, starts = self._served_file(split, seq, schema, picks, before)
        metadata = {
            "dataset": self.context.dataset_name,
            "split": split,
            "batch_size": b,
            "schema": [f.to_dict() for f in schema],
        }
        encoded = encode_batch_file(
            seq=seq, tensors=tensors, metadata=metadata, version=self.format_version
        )
        # This file holds those rows, so no other file names them; its publisher records them.
        return replace(encoded, epoch_starts=tuple(starts))

    def provenance(self, split: str, seq: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Each row's source, from the row schedule in closed form (as make_file draws it),
        and where that source's own row came from (its provider's provenance)."""
        if split not in self._schemas:
            raise ValueError(f"no split {split!r}; the splits are {sorted(self._schemas)}")
        per_file, first = self.rows_per_file, seq * self.rows_per_file
        at = check_rows(rows, per_file, f"mixture split {split!r} seq {seq}")
        schedule = self.row_schedule(split)
        picks = np.array(schedule.sources_of(first, first + per_file), dtype=np.int64)
        before = schedule.counts(first)
        out: list[dict[str, Any]] = [{} for _ in at]
        for s, source in enumerate(self._rows):
            wanted = np.flatnonzero(picks[at] == s)
            # Row p of the source's stream: the rows it gave earlier files, then this one's.
            stream = before[s] + np.searchsorted(np.flatnonzero(picks == s), at[wanted])
            files, offsets = np.divmod(stream, per_file)
            for file in np.unique(files).tolist():
                here = files == file
                try:
                    said = source.provider.provenance(split, file, offsets[here].tolist())
                except ValueError as exc:
                    raise ValueError(f"mixture source {source.name!r}: {exc}") from None
                for i, entry in zip(wanted[here].tolist(), said, strict=True):
                    out[i] = {**entry, "source": source.name}
        return out

    def copies_stored_rows(self, split: str) -> bool:
        """Whether `split`'s files are made from the stored rows of the sources' files, as
        they hold them (format 3, every field stored row by row in a dtype numpy holds): the
        same bytes as decoding the rows and encoding them again, at a fraction of the work,
        and without torch."""
        if self.format_version < 3:
            return False
        return all(_row_copied(f) for f in self._codecs[split].schema)

    def _gather(
        self,
        split: str,
        picks: np.ndarray,
        before: Sequence[int],
        take: Callable[..., Mapping[str, Any]],
    ) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
        """Each source's rows of this file, `take(rows, split, start, stop, per_file)`, put
        where the schedule places them ([rows, ...] per name), and the source epochs whose
        first row is here."""
        per_file = self.rows_per_file
        out: dict[str, Any] = {}
        starts: list[tuple[str, int, int]] = []
        for s, rows in enumerate(self._rows):
            where = np.flatnonzero(picks == s)
            if where.size == 0:
                continue
            got = take(rows, split, before[s], before[s] + where.size, per_file)
            for name, values in got.items():
                if name not in out:
                    out[name] = _empty_like_rows(values, per_file)
                out[name][where] = values
            starts += [
                (rows.name, epoch, row)
                for row, epoch in rows.epoch_starts(split, before[s], before[s] + where.size)
            ]
        return out, starts

    def _stored_file(
        self, split: str, seq: int, picks: np.ndarray, before: Sequence[int]
    ) -> tuple[Mapping[str, np.ndarray], list[tuple[str, int, int]]]:
        """The file's stored tensors, copied from the sources' stored rows (numpy only)."""
        k, b = self.context.batches_per_file, self.batch_size
        stored, starts = self._gather(split, picks, before, SourceRows.stored_rows)
        codec = self._codecs[split]
        (source,) = (f for f in codec.schema if f.name == SOURCE_FIELD)
        stored[source.stored_name] = picks.astype(source.stored_as)
        if set(stored) != set(codec.stored_names):
            raise MetaError(
                f"split {split!r} seq {seq}: the sources' files store {sorted(stored)}, "
                f"the mixture's schema stores {sorted(codec.stored_names)}"
            )
        tensors = {n: stored[n].reshape(k, b, *stored[n].shape[1:]) for n in codec.stored_names}
        return tensors, starts

    def _served_file(
        self,
        split: str,
        seq: int,
        schema: Sequence[FieldSpec],
        picks: np.ndarray,
        before: Sequence[int],
    ) -> tuple[Mapping[str, torch.Tensor], list[tuple[str, int, int]]]:
        """The file's stored tensors by decoding the sources' rows, checking them against
        the schema and encoding them again (any storage, any format)."""
        import torch

        k, b = self.context.batches_per_file, self.batch_size
        tensors, starts = self._gather(split, picks, before, SourceRows.rows)
        tensors = {n: v.reshape(k, b, *v.shape[1:]) for n, v in tensors.items()}
        tensors[SOURCE_FIELD] = torch.from_numpy(picks).reshape(k, b)
        tensors = {f.name: tensors[f.name] for f in schema}
        for i in range(k):
            check_tensors(schema, {n: v[i] for n, v in tensors.items()}, (b,))
        check_ids(tensors, self._id_ranges.get(split, ()), where=f"split {split!r} seq {seq}")
        stored = (
            encode_stored(self._codecs[split], tensors) if self.format_version >= 2 else tensors
        )
        return stored, starts


def _row_copied(f: FieldSpec) -> bool:
    st = f.storage
    return (
        st.kind in _ROW_COPY_KINDS
        and not st.lengths
        and not st.exceptions
        and f.stored_as in NUMPY_DTYPES
    )


def _empty_like_rows(values: Any, rows: int) -> Any:
    """Room for `rows` rows like `values` (a numpy array or a tensor, [n, ...])."""
    if isinstance(values, np.ndarray):
        return np.empty((rows, *values.shape[1:]), dtype=values.dtype)
    import torch

    return torch.empty((rows, *values.shape[1:]), dtype=values.dtype)
