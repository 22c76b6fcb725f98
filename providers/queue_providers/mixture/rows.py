"""A source's rows by position in its own stream, as a mixture worker takes them.

Row p of a source is row p % R of the source provider's own file p // R (R rows per file),
so a source's rows in the mixture are exactly its own stream, whatever the weights and the
number of workers: nothing skipped, nothing repeated.

A stateless source makes any file from its seq alone. A streaming source (text_lm) makes
file k from the stream state after file k - 1, so every worker runs the source's whole
stream itself: it makes the source's files in order, keeps the last one, and drops those
whose rows only other workers' mixture files take. Its state, journaled with each mixture
file, is the stream state at the start of the oldest source file it may still need (the one
it keeps), so a worker restarted from it, or a mixture file made again from it, makes the
same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.format import batchfile_v3
from queue_client.format.batchfile import FORMAT_VERSION, EncodedBatchFile, load_batch_bytes
from queue_providers.base import DataProviderBase

if TYPE_CHECKING:
    import torch

STATE_KEYS = frozenset({"file", "state"})


class MadeFile:
    """A source file this worker made, read on first use as its served fields (torch) or as
    its stored tensors (numpy views of its bytes: a mixture that copies stored rows never
    imports torch), each [rows, ...]. A window provider hands its stored tensors over
    unencoded (`tensors`): such a file has no bytes, and serves its stored rows only."""

    def __init__(
        self,
        seq: int,
        where: str,
        data: bytes | None = None,
        tensors: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.seq, self.where, self.data = seq, where, data
        if tensors is not None:
            self.__dict__["stored"] = {k: v.reshape(-1, *v.shape[2:]) for k, v in tensors.items()}

    @cached_property
    def served(self) -> dict[str, torch.Tensor]:
        assert self.data is not None, "a file made unencoded serves its stored rows only"
        served = load_batch_bytes(self.data, self.where).tensors
        return {k: v.reshape(-1, *v.shape[2:]) for k, v in served.items()}

    @cached_property
    def stored(self) -> dict[str, np.ndarray]:
        assert self.data is not None
        layout = batchfile_v3.parse(memoryview(self.data), self.where, FORMAT_VERSION)
        arrays = batchfile_v3.arrays(self.data, layout)
        return {k: v.reshape(-1, *v.shape[2:]) for k, v in arrays.items()}


class SourceRows:
    """One source's served rows by position in its own stream, the last file made cached,
    and the rows of its stream where an epoch starts, as far as its files were made."""

    def __init__(self, provider: DataProviderBase, name: str = "") -> None:
        self.provider = provider
        self.name = name
        self._cached: dict[str, MadeFile] = {}
        self._epoch_starts: dict[str, dict[int, int]] = {}

    def _make(self, split: str, seq: int, per_file: int) -> EncodedBatchFile:
        encoded = self.provider.make_file(split, seq)
        self._note_epochs(split, seq, per_file)
        return encoded

    def _note_epochs(self, split: str, seq: int, per_file: int) -> None:
        for row, epoch in self.provider.epoch_starts(split, seq):
            self._epoch_starts.setdefault(split, {})[seq * per_file + row] = epoch

    def _file(self, split: str, seq: int, per_file: int, stored: bool = False) -> MadeFile:
        """The source's file `seq`, made unless it is the one made last; for its `stored`
        rows, as the provider's unencoded tensors where it makes them directly."""
        cached = self._cached.get(split)
        if cached is not None and cached.seq == seq and (stored or cached.data is not None):
            return cached
        where = f"source {self.name} file {seq}"
        tensors = self.provider.stored_tensors(split, seq) if stored else None
        if tensors is not None:
            self._note_epochs(split, seq, per_file)
            made = MadeFile(seq, where, tensors=tensors)
        else:
            made = MadeFile(seq, where, data=self._make(split, seq, per_file).data)
        self._cached[split] = made
        return made

    def _parts(
        self,
        split: str,
        start: int,
        stop: int,
        per_file: int,
        read: Callable[[MadeFile], Any],
        stored: bool = False,
    ) -> list[dict[str, Any]]:
        """Rows [start, stop) of the source's stream, a dict of `read(file)` slices per file."""
        parts: list[dict[str, Any]] = []
        p = start
        while p < stop:
            seq, offset = divmod(p, per_file)
            take = min(stop - p, per_file - offset)
            file_rows = read(self._file(split, seq, per_file, stored))
            parts.append({k: v[offset : offset + take] for k, v in file_rows.items()})
            p += take
        return parts

    def rows(self, split: str, start: int, stop: int, per_file: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) of the source's stream: every served field."""
        parts = self._parts(split, start, stop, per_file, lambda f: f.served)
        if not parts:
            return {}
        import torch

        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}

    def stored_rows(
        self, split: str, start: int, stop: int, per_file: int
    ) -> dict[str, np.ndarray]:
        """Rows [start, stop) of the source's stream: every stored tensor, as its files hold
        them (without torch)."""
        parts = self._parts(split, start, stop, per_file, lambda f: f.stored, stored=True)
        if not parts:
            return {}
        return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}

    def epoch_starts(self, split: str, start: int, stop: int) -> list[tuple[int, int]]:
        """(row, epoch) of each row in [start, stop) that starts an epoch, once those rows
        were taken (their files made)."""
        known = self._epoch_starts.get(split, {})
        return sorted((row, e) for row, e in known.items() if start <= row < stop)

    # ---- state (a streaming source's) ----------------------------------------------------
    def state(self, split: str) -> dict[str, Any]:
        return {}

    def load(self, split: str, state: Mapping[str, Any]) -> None:
        pass


class StreamingSourceRows(SourceRows):
    """A streaming source: its files made in order by this worker's own copy of its stream."""

    def __init__(self, provider: DataProviderBase, name: str = "") -> None:
        super().__init__(provider, name)
        self._next: dict[str, int] = {}  # the file the live stream makes next
        self._cached_before: dict[str, dict[str, Any]] = {}  # stream state at the cached file

    def _make(self, split: str, seq: int, per_file: int) -> EncodedBatchFile:
        nxt = self._next.get(split, 0)
        if seq < nxt:
            raise RuntimeError(
                f"source {self.name!r} split {split!r}: file {seq} is behind its stream "
                f"(at file {nxt}) and not kept; the mixture state does not fit this file"
            )
        while True:
            before = self.provider.state_dict(split)
            encoded = self.provider.make_file(split, nxt)
            self._note_epochs(split, nxt, per_file)
            self._next[split] = nxt = nxt + 1
            if nxt > seq:  # the one asked for: the stream state at its start is kept with it
                self._cached_before[split] = before
                return encoded

    def state(self, split: str) -> dict[str, Any]:
        """Where this worker's copy of the stream can be rebuilt from: the kept file and
        the stream state at its start, or the live stream when nothing is kept."""
        cached = self._cached.get(split)
        if cached is not None:
            return {"file": cached.seq, "state": self._cached_before[split]}
        return {"file": self._next.get(split, 0), "state": self.provider.state_dict(split)}

    def load(self, split: str, state: Mapping[str, Any]) -> None:
        if set(state) != STATE_KEYS:
            raise ValueError(
                f"source {self.name!r} split {split!r}: state has keys {sorted(state)}, "
                f"expected {sorted(STATE_KEYS)}"
            )
        file = state["file"]
        if not isinstance(file, int) or isinstance(file, bool) or file < 0:
            raise ValueError(f"source {self.name!r} split {split!r}: state file {file!r} < 0")
        self.provider.load_state_dict(split, state["state"])
        self._next[split] = file
        self._cached.pop(split, None)
        self._cached_before.pop(split, None)


def source_rows(provider: DataProviderBase, name: str) -> SourceRows:
    return StreamingSourceRows(provider, name) if provider.streams else SourceRows(provider, name)
