"""DataProviderBase: the one class a dataset subclasses to be served by batchqueue.

A subclass overrides `build_meta` and `sample_batch`; the base owns everything else: strict meta
validation, the per-file RNG, stacking batches into a file and publishing it atomically. The
server runs providers in worker processes and decides *which* seq each worker produces next, so
backpressure and ordering live in the server, not here.

Storage: a file stores what each schema field's `storage` says (narrow token ids, x and y as
one window, no derivable masks; queue_client/format/storage.py), in batch file format version 3.
sample_batch still returns the served fields; make_file encodes them and checks that they
read back identically. A dataset dir keeps writing the format its meta records
("batch_format_version": 2 keeps torch.save zips of the same storage); one whose meta
predates the key keeps writing version 1 files, the served fields as they are.

Determinism: a file's content is a pure function of (config, seed, split, seq) for stateless
providers, since the RNG is seeded from exactly those. A provider that streams (reads documents
in order) also overrides `state_dict`/`load_state_dict`; the server journals the state before
each file so any seq can be produced again.

torch is imported where a method needs it, not with this module: a provider that makes its
files with numpy (char_lm) runs in a worker that never imports it (a second or more of a
worker's start, and much of its memory).
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from queue_client.errors import MetaError
from queue_client.format.batchfile import (
    FORMAT_VERSION,
    VERSIONS,
    EncodedBatchFile,
    PublishedFile,
    encode_batch_file,
    publish_batch_file,
)
from queue_client.format.layout import DatasetLayout
from queue_client.format.meta import split_schema, validate_meta
from queue_client.format.schema import FieldSpec, check_tensors
from queue_client.format.storage import BatchCodec, codec_for
from queue_client.format.storage_encode import encode_stored
from queue_providers.histograms import token_histograms
from queue_providers.inputs import Input, describe_inputs, inputs_fingerprint, path_args
from queue_providers.seeding import derive_seed, torch_generator
from queue_providers.token_ids import IdRange, check_ids, id_ranges

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ProviderContext:
    """What the server tells a provider about where and as whom it runs."""

    dataset_name: str
    dataset_dir: Path
    batch_size: int
    batches_per_file: int = 100
    seed: int = 1337
    # This process's place among the split's workers: a streaming provider reads only the
    # documents of shard worker_index of num_workers, so no two workers see the same document.
    worker_index: int = 0
    num_workers: int = 1
    verbose: bool = False
    # Provider-independent facts recorded into meta (the config fingerprint, the provider name).
    extra_meta: Mapping[str, Any] = field(default_factory=dict)
    # The schema field whose per-batch token histograms go into each file ("" for none): set
    # for the workers of a curriculum split, whose composer scores batches by them.
    histogram_field: str = ""

    @property
    def layout(self) -> DatasetLayout:
        """The paths under dataset_dir (artifacts, tokenizer, ...), as queue_client names them."""
        directory = Path(self.dataset_dir)
        return DatasetLayout(directory.parent, directory.name)


class DataProviderBase(abc.ABC):
    """Base of every provider. Subclasses take their config args as keyword-only parameters."""

    # The config args as the worker received them: registry.create sets them after
    # construction (a provider built by hand has none), for data_identity().
    config_args: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, context: ProviderContext) -> None:
        self.context = context
        self._schemas: dict[str, tuple[FieldSpec, ...]] = {}
        self._id_ranges: dict[str, tuple[IdRange, ...]] = {}
        self._codecs: dict[str, BatchCodec] = {}
        self.format_version = FORMAT_VERSION

    # ---- what a dataset overrides -------------------------------------------------------
    @abc.abstractmethod
    def build_meta(self) -> dict[str, Any]:
        """The dataset's meta: training_type, batch_schema, split_info and the keys the
        training type needs (vocab_size, block_size, ...). dataset_name and batch_size are
        filled in by the base."""

    @abc.abstractmethod
    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """One batch: a tensor per schema field, shaped [batch_size, *field.shape]."""

    def state_dict(self, split: str) -> dict[str, Any]:
        """JSON-serialisable stream state of `split` (empty for stateless providers)."""
        return {}

    def load_state_dict(self, split: str, state: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict`, to produce a journaled seq again."""
        if state:
            raise ValueError(
                f"{type(self).__name__} is stateless but was given state {dict(state)!r}"
            )

    @property
    def streams(self) -> bool:
        """Whether each file depends on the stream state before it, so that the server
        journals a state per file (by default: whether state_dict is overridden)."""
        return type(self).state_dict is not DataProviderBase.state_dict

    # Whether the data has a finite, ordered epoch (each row once per epoch, then the next
    # epoch), whose boundaries epoch_starts reports; False for providers that sample.
    ordered_epochs: bool = False

    def epoch_starts(self, split: str, seq: int) -> list[tuple[int, int]]:
        """Called right after make_file(split, seq): (row of the file, epoch) for each row
        that starts an epoch past the first, rows numbered from 0 in the file (batch by
        batch). Empty for a provider without ordered epochs."""
        return []

    def provenance(self, split: str, seq: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Where each of `rows` of file `seq` came from (queue_providers/provenance.py: file,
        token_offset, document; source for a mixture), by the arithmetic that makes the file,
        never reading the corpus. Refused where a provider cannot say it that way."""
        why = "its rows depend on the stream read before them" if self.streams else "none given"
        raise ValueError(f"explain is not available for provider {type(self).__name__} ({why})")

    # ---- provided --------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.context.batch_size

    def input_files(self) -> Sequence[Input]:
        """Every file the dataset is made from (corpus, tokenizer, label files): a dataset dir
        is refused once any of them changes. The default is every existing file a config arg
        names, and every file under a directory one names; a provider that knows its inputs
        exactly overrides this, so an unrelated file beside them never blocks a start."""
        return path_args(self.args_for_identity(), exclude=Path(self.context.dataset_dir).parent)

    def fixed_inputs(self) -> bool:
        """True when input_files() lists local files that the args name one by one: no
        directory, pattern, listing, URL or file that is an input only when present. The
        records made at build are then the whole input set, so a restarted server checks them
        itself (size and mtime, as a worker would) and serves the files on disk before any
        worker has started. A provider whose inputs could grow says False, the default."""
        return False

    def complete_meta(
        self, inputs: Mapping[str, Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """build_meta() plus the keys the base owns, validated strictly.

        meta["inputs_fingerprint"] is the fingerprint of `inputs` (records of input_files(),
        as queue_providers.inputs.describe_inputs makes them; described now when None)."""
        meta = dict(self.build_meta())
        for key, value in (
            ("dataset_name", self.context.dataset_name),
            ("batch_size", self.batch_size),
        ):
            if key in meta and meta[key] != value:
                raise MetaError(
                    f"build_meta() set {key}={meta[key]!r} but the config says {value!r}"
                )
            meta[key] = value
        meta["batches_per_file"] = self.context.batches_per_file
        meta["batch_format_version"] = FORMAT_VERSION
        records = describe_inputs(self.input_files()) if inputs is None else inputs
        meta["inputs_fingerprint"] = inputs_fingerprint(records)
        if self.fixed_inputs():
            meta["inputs_fixed"] = True
        meta.update(self.context.extra_meta)
        validate_meta(meta, where=f"{type(self).__name__}.build_meta()")
        return meta

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        """Learn the split schemas from the meta the server settled on."""
        self._schemas = {split: split_schema(meta, split) for split in meta["split_info"]}
        self._id_ranges = {split: id_ranges(meta, s) for split, s in self._schemas.items()}
        self._codecs = {split: codec_for(s) for split, s in self._schemas.items()}
        self.format_version = batch_format_version(meta)

    def file_rng(self, split: str, seq: int) -> torch.Generator:
        """The RNG for one file: seeded from (seed, split, seq) alone, with all 63 bits of the
        derived seed (manual_seed would keep 32, and files would repeat; see seeding.py)."""
        return torch_generator(derive_seed(self.context.seed, split, seq))

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        """Sample batches_per_file batches, check them against the schema, encode the file.

        The bytes depend on (config, seed, split, seq, stream state) alone, never on when or
        where they were made, so a Ray actor and a local worker make identical files. A
        subclass that must act around making a file (position its stream, undo a failure)
        overrides this, not produce_file, which the Ray backend never calls.
        """
        schema = self._schemas.get(split)
        if schema is None:
            raise MetaError(f"split {split!r} is not in meta split_info {sorted(self._schemas)}")
        import torch

        rng = self.file_rng(split, seq)
        batches = [self.sample_batch(split, rng) for _ in range(self.context.batches_per_file)]
        for b in batches:
            check_tensors(schema, b, (self.batch_size,))
        tensors = {f.name: torch.stack([b[f.name] for b in batches]) for f in schema}
        check_ids(tensors, self._id_ranges.get(split, ()), where=f"split {split!r} seq {seq}")
        return self.encode_file(split, seq, tensors)

    def window_dtype(self, split: str) -> np.dtype | None:
        """The dtype of the one stored window of T+1 ids that a file of x and y keeps (format 2
        and later), for a provider that gathers its windows into it directly; None where the
        split's files store anything else."""
        codec = self._codecs.get(split)
        if self.format_version < 2 or codec is None or codec.names != ["x", "y"]:
            return None
        if len(codec.stored_names) != 1:
            return None
        return np.dtype(codec.schema[0].stored_as)

    def file_windows(self, split: str, seq: int) -> np.ndarray | None:
        """The stored window of file `seq` ([batches_per_file, batch_size, T+1] of
        window_dtype), for a provider that makes it directly: what its file stores, without
        encoding it (a mixture copies rows from it). None where the provider makes its files
        otherwise, or the split's files store anything else."""
        return None

    def stored_tensors(self, split: str, seq: int) -> dict[str, np.ndarray] | None:
        """The stored tensors of file `seq` by name, as its file holds them but not encoded,
        where the provider makes them directly (file_windows); None otherwise."""
        windows = self.file_windows(split, seq)
        if windows is None:
            return None
        return {self._codecs[split].stored_names[0]: windows}

    def encode_windows(
        self, split: str, seq: int, windows: torch.Tensor | np.ndarray
    ) -> EncodedBatchFile:
        """File `seq` from its stored windows ([batches_per_file, batch_size, T+1] of
        window_dtype, a tensor or a numpy array): the bytes encode_file makes of x =
        windows[..., :-1] and y = windows[..., 1:] widened, without widening them."""
        codec = self._codecs[split]
        served = {"x": windows[..., :-1], "y": windows[..., 1:]}  # for histograms only
        return self.encode_file(split, seq, served, {codec.stored_names[0]: windows})

    def encode_file(
        self,
        split: str,
        seq: int,
        served: Mapping[str, torch.Tensor | np.ndarray],
        stored: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    ) -> EncodedBatchFile:
        """File `seq` of `split` from its served fields ([batches_per_file, batch_size, ...]
        each), encoded as the dataset's format stores them. A subclass that makes the stored
        tensors itself passes them as `stored` (exactly what the codec would make of
        `served`); `served` is then read only for the token histograms of a curriculum
        split, and may hold narrow views. numpy arrays are taken where tensors are, for
        `stored` in format 3 (the one format written without torch) and for the histograms."""
        metadata: dict[str, Any] = {
            "dataset": self.context.dataset_name,
            "split": split,
            "batch_size": self.batch_size,
            "schema": [f.to_dict() for f in self._schemas[split]],
        }
        extras = None
        if self.context.histogram_field:
            extras = token_histograms(served, self.context.histogram_field)
            metadata["histogram_field"] = self.context.histogram_field
        version = self.format_version
        if stored is None:
            import torch  # the codec's encoding is torch's

            tensors = {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in served.items()
            }
            stored = encode_stored(self._codecs[split], tensors) if version >= 2 else tensors
        return encode_batch_file(
            seq=seq, tensors=stored, metadata=metadata, extras=extras, version=version
        )

    def produce_file(self, split: str, seq: int, directory: Path) -> PublishedFile:
        """make_file, then publish it atomically into `directory` (its name carries the time)."""
        return publish_batch_file(Path(directory), self.make_file(split, seq))

    def corpus_token_counts(
        self,
        split: str,
        n_tokens: int,
        field_name: str,
        vocab_size: int,
        progress: Callable[[int], None] = lambda _n: None,
    ) -> torch.Tensor:
        """Token counts (int64 [vocab_size]) of about n_tokens tokens spread over all the data.

        The default draws batches from seeds of their own, which for providers that sample
        random windows (char_lm, nanogpt_bin) is a uniform sample of the whole corpus. A
        provider that streams documents in order overrides this, or it would count a prefix.
        `progress(n)` is told how many tokens were added.
        """
        import torch

        counts = torch.zeros(vocab_size, dtype=torch.int64)
        seen, draw = 0, 0
        while seen < n_tokens:
            rng = torch_generator(derive_seed(self.context.seed, "corpus", split, draw))
            tokens = self.sample_batch(split, rng)[field_name].reshape(-1).to(torch.int64)
            tokens = tokens[tokens >= 0]
            counts += torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
            seen += int(tokens.numel())
            draw += 1
            progress(int(tokens.numel()))
            if tokens.numel() == 0 and draw > 1000:
                raise ValueError(f"field {field_name!r} of split {split!r} holds no token ids >= 0")
        return counts

    def data_identity(self) -> str:
        """What the data is, for caches derived from it: every file or directory named by an
        arg (with its size and mtime), plus the args themselves. A provider whose data lives
        elsewhere overrides this."""
        return json.dumps(_describe_paths(self.args_for_identity()), sort_keys=True, default=str)

    def args_for_identity(self) -> Mapping[str, Any]:
        """The config args, as the worker received them (set by the registry)."""
        return self.config_args

    def on_start(self) -> None:
        """Called once in the worker process before the first file."""

    def on_stop(self) -> None:
        """Called once when the worker process shuts down cleanly."""


def batch_format_version(meta: Mapping[str, Any]) -> int:
    """The batch file format a dataset's files are written in: meta's batch_format_version,
    or 1 for a dataset dir built before the key existed (its files stay as they were)."""
    version = meta.get("batch_format_version", 1)
    if version not in VERSIONS:
        raise MetaError(
            f"meta batch_format_version {version!r} is not one this batchqueue writes "
            f"({list(VERSIONS)}); the dataset dir was built by a newer batchqueue: upgrade it, "
            "or `queue-server reset` the dataset"
        )
    return int(version)


def _describe_paths(value: Any) -> Any:
    """`value` with every string that names an existing path replaced by what it holds now."""
    if isinstance(value, Mapping):
        return {str(k): _describe_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe_paths(v) for v in value]
    if isinstance(value, str) and value and len(value) < 4096:
        path = Path(value)
        try:
            if path.is_file():
                st = path.stat()
                return {"path": value, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            if path.is_dir():
                entries = []
                for root, dirs, files in os.walk(path):
                    dirs.sort()
                    for name in sorted(files):
                        st = os.stat(os.path.join(root, name))
                        entries.append(
                            [
                                os.path.relpath(os.path.join(root, name), path),
                                st.st_size,
                                st.st_mtime_ns,
                            ]
                        )
                        if len(entries) >= 100_000:
                            break
                return {"dir": value, "files": entries}
        except OSError:
            return value
    return value
