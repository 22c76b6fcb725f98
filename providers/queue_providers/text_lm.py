"""text_lm: a streaming text corpus, tokenized and packed into fixed [A, B, T] LM batches.

Sources are .txt files (a document per file, or split by a separator line), JSONL (a text
key) or Parquet (a text column), read as streams. Tokenizers are byte, char, hf (a file, a
folder or a cached hub name) or tiktoken. Packing is
sequential (one stream, no padding) or bin (whole documents best-fit). val is the corpus's
first `eval_take` documents and train the rest; each worker of a split reads a disjoint shard,
reshuffled every epoch. The stream's state is journaled with each file, so any file can be
produced again byte for byte. docs/providers/text_lm.md is the user's page.

Shapes: the config's batch_size is A (grad_accum) and args.micro_batch_size is B, so each
schema field is [B, T] and sample_batch returns [A, B, T]: one batch is one optimizer step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from queue_client.errors import ConfigError, MetaError
from queue_client.format.batchfile import EncodedBatchFile
from queue_providers.base import DataProviderBase, ProviderContext
from queue_providers.compact import packed_lm_schema
from queue_providers.inputs import Input
from queue_providers.remote import RemoteSettings, RemoteStore
from queue_providers.text.corpus import open_corpus
from queue_providers.text.errors import CorpusError
from queue_providers.text.files import corpus_digest
from queue_providers.text.packing import IGNORE, PACKING_MODES
from queue_providers.text.plan import (
    CHUNKS_PER_WORKER,
    Boundary,
    find_boundary,
    iter_corpus,
    make_chunks,
    shard,
    split_ranges,
)
from queue_providers.text.readers import ReadOptions, iter_docs
from queue_providers.text.stream import SplitStream, StreamConfig
from queue_providers.text.tokenizer import TextTokenizer, parse_tokenizer_arg, tokenizer_files
from queue_providers.text.tokenizer_snapshot import load_tokenizer, prepare_tokenizer

__all__ = ["CorpusError", "TextLMProvider"]

# Chunks the corpus sample of a curriculum is drawn from, each an equal share.
_SAMPLE_CHUNKS = 256


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"text_lm {name} must be a positive int, got {value!r}")
    return value


class TextLMProvider(DataProviderBase):
    """Packed LM windows of a streamed text corpus; see the module docstring."""

    def __init__(
        self,
        context: ProviderContext,
        *,
        source: str | list[str] | None = None,
        tokenizer: str = "byte",
        seq_len: int = 1024,
        micro_batch_size: int = 8,
        packing: str = "sequential",
        eval_take: int = 1000,
        shuffle: bool = True,
        shuffle_buffer: int = 1024,
        format: str = "auto",
        separator: str | None = None,
        text_key: str = "text",
        tokenizer_path: str | None = None,
        eos_token: str | None = None,
        tiktoken_pattern: str | None = None,
        utf8_errors: str = "replace",
        max_document_bytes: int = 64 << 20,
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_revision: str | None = None,
        hf_splits: dict[str, str] | None = None,
        remote: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        self.shuffle_buffer = _positive_int("shuffle_buffer", shuffle_buffer)
        if packing not in PACKING_MODES:
            raise ConfigError(
                f"text_lm packing must be one of {list(PACKING_MODES)}, got {packing!r}"
            )
        if not isinstance(eval_take, int) or isinstance(eval_take, bool) or eval_take < 0:
            raise ConfigError(f"text_lm eval_take must be an int >= 0, got {eval_take!r}")
        if not isinstance(shuffle, bool):
            raise ConfigError(f"text_lm shuffle must be true or false, got {shuffle!r}")
        # A tokenizer named by the config (a hub name, a tiktoken encoding) is looked up when
        # meta is built, not here: every worker loads the dataset's snapshot instead.
        tokenizer, tokenizer_path = parse_tokenizer_arg(tokenizer, tokenizer_path)
        self.tiktoken_pattern = tiktoken_pattern
        self.packing = packing
        self.eval_take = eval_take
        self.shuffle = shuffle
        self.tokenizer_kind = tokenizer
        self.tokenizer_path = tokenizer_path
        self.eos_token = eos_token
        self.opts = ReadOptions(
            separator=separator,
            text_key=text_key,
            utf8_errors=utf8_errors,
            max_document_bytes=_positive_int("max_document_bytes", max_document_bytes),
        )
        # Listing and stat-ing the files is cheap; reading them waits for build_meta/set_meta.
        self.store = RemoteStore(
            RemoteSettings.from_config(
                remote, cache_dir=context.layout.input_cache_dir, who="text_lm"
            )
        )
        self.corpus = open_corpus(
            source,
            hf_dataset=hf_dataset,
            hf_config=hf_config,
            hf_revision=hf_revision,
            hf_splits=hf_splits,
            format=format,
            one_doc_per_file=separator is None,
            store=self.store,
        )
        self.files, self.source = self.corpus.files, self.corpus.shown
        self.tokenizer: TextTokenizer | None = None
        self._meta: Mapping[str, Any] | None = None
        self._streams: dict[str, SplitStream] = {}
        # Per split, of the file being made or made last: the epoch before it, each row's.
        self._made_epochs: dict[str, tuple[int, list[int]]] = {}

    # ---- meta -------------------------------------------------------------------------------
    def input_files(self) -> Sequence[Input]:
        """The corpus files and the tokenizer's files (the snapshot under the dataset keeps
        serving consistent, but a replaced tokenizer means the config asks for other data)."""
        tokenizer = tokenizer_files(
            self.tokenizer_kind,
            self.tokenizer_path,
            eos_token=self.eos_token,
            pattern=self.tiktoken_pattern,
        )
        return [*(f.path for f in self.files), *tokenizer]

    def build_meta(self) -> dict[str, Any]:
        fixed = self.corpus.fixed_boundary()  # val is a split of a Hugging Face dataset
        boundary = fixed or find_boundary(self.files, self.opts, self.eval_take, self.source)
        tok, info = prepare_tokenizer(
            self.tokenizer_kind,
            self.context.layout,
            tokenizer_path=self.tokenizer_path,
            eos_token=self.eos_token,
            pattern=self.tiktoken_pattern,
            corpus_texts=lambda: (text for _, _, text in iter_corpus(self.files, self.opts)),
        )
        a, b, t = self.batch_size, self.micro_batch_size, self.seq_len
        # Train starts at document eval_take of the corpus; val is the documents before it.
        splits = self.corpus.split_info(self.eval_take)
        meta: dict[str, Any] = {
            "training_type": "LM",
            "vocab_size": tok.vocab_size,
            "block_size": t,
            "seq_len": t,
            "grad_accum": a,
            "micro_batch_size": b,
            "packing": self.packing,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "ignore_index": IGNORE,
            "tokenizer": info,
            # A file stores one window of T+1 ids per row (uint16 up to 65,536 ids) and, with
            # bin packing, each row's length: labels, segment_ids and the mask follow.
            "batch_schema": packed_lm_schema(
                [b, t],
                tok.vocab_size,
                eos_id=tok.eos_id,
                ignore=IGNORE,
                padded=self.packing == "bin",
            ),
            "split_info": splits,
            "text_lm": {
                "corpus_files": len(self.files),
                "corpus_bytes": sum(f.size for f in self.files),
                "corpus_digest": corpus_digest(self.files),
                "boundary": [boundary.file, boundary.key] if self.eval_take or fixed else None,
                "eval_take": self.eval_take,
                "shuffle_buffer": self.shuffle_buffer,
                **({"hf": self.corpus.hf_info} if self.corpus.hf_info else {}),
            },
        }
        if tok.kind == "char":
            chars = info["chars"]
            meta["stoi"] = {ch: i for i, ch in enumerate(chars)}
            meta["itos"] = dict(enumerate(chars))
        return meta

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        super().set_meta(meta)
        info = meta.get("text_lm")
        if not isinstance(info, Mapping):
            raise MetaError("meta lacks the 'text_lm' table that TextLMProvider.build_meta writes")
        digest = corpus_digest(self.files)
        if digest != info["corpus_digest"]:
            raise CorpusError(
                f"text_lm source {self.source!r} changed since meta.pkl was built: it had "
                f"{info['corpus_files']} file(s) of {info['corpus_bytes']} bytes, now "
                f"{len(self.files)} of {sum(f.size for f in self.files)}; rebuild the dataset"
            )
        self.tokenizer = load_tokenizer(self.context.layout, meta["tokenizer"])
        self._meta = meta
        self._streams = {}

    # ---- batches ----------------------------------------------------------------------------
    def _stream(self, split: str) -> SplitStream:
        stream = self._streams.get(split)
        if stream is not None:
            return stream
        if self._meta is None or self.tokenizer is None:
            raise MetaError("TextLMProvider: set_meta() must run before batches are produced")
        info = self._meta["text_lm"]
        raw = info["boundary"]
        boundary = None if raw is None else Boundary(int(raw[0]), int(raw[1]))
        ranges = split_ranges(self.files, boundary)
        if split not in ranges:
            raise MetaError(f"text_lm has no split {split!r}; it has {sorted(ranges)}")
        ctx = self.context
        chunks = shard(
            make_chunks(self.files, ranges[split], ctx.num_workers),
            ctx.worker_index,
            ctx.num_workers,
        )
        config = StreamConfig(
            split=split,
            seq_len=self.seq_len,
            packing=self.packing,
            block_docs=self.shuffle_buffer,
            shuffle=self.shuffle and split == "train",
            seed=ctx.seed,
            worker_index=ctx.worker_index,
            num_workers=ctx.num_workers,
            pad_id=self.tokenizer.pad_id,
        )
        layout = _layout(info, self._meta["tokenizer"]["sha256"], config)
        stream = SplitStream(self.files, self.opts, chunks, self.tokenizer, config, layout)
        self._streams[split] = stream
        return stream

    def sample_batch(self, split: str, rng: torch.Generator) -> dict[str, torch.Tensor]:
        # `rng` is unused: order comes from the journaled stream state, seeded by (seed, epoch).
        a, b, t = self.batch_size, self.micro_batch_size, self.seq_len
        stream = self._stream(split)
        windows = stream.take(a * b)
        made = self._made_epochs.get(split)
        if made is not None:  # a row's epoch: that of its first window
            made[1].extend(stream.taken_epochs[::b].tolist())
        return {name: torch.from_numpy(arr.reshape(a, b, t)) for name, arr in windows.items()}

    def make_file(self, split: str, seq: int) -> EncodedBatchFile:
        """The base's make_file, but a failure leaves the stream where it was, so a retry
        (or the server's replay) starts from the same documents and nothing is skipped."""
        before = self.state_dict(split)
        self._made_epochs[split] = (self._stream(split).epoch, [])
        try:
            return super().make_file(split, seq)
        except BaseException:
            self.load_state_dict(split, before)
            self._made_epochs.pop(split, None)
            raise

    ordered_epochs = True

    def epoch_starts(self, split: str, seq: int) -> list[tuple[int, int]]:
        """The rows of the file just made whose epoch is past the row's before them (the
        stream reads every document of its shard once per epoch)."""
        made = self._made_epochs.get(split)
        if made is None:
            return []
        previous, epochs = made
        out = []
        for row, epoch in enumerate(epochs):
            if epoch > previous:
                out.append((row, epoch))
            previous = epoch
        return out

    # ---- curriculum ---------------------------------------------------------------------------
    def data_identity(self) -> str:
        """The corpus's files (names, sizes, mtimes) and the args: what a corpus sample of it
        depends on, besides the tokenizer."""
        return json.dumps([corpus_digest(self.files), self.args_for_identity()], default=str)

    def corpus_token_counts(
        self,
        split: str,
        n_tokens: int,
        field_name: str,
        vocab_size: int,
        progress: Callable[[int], None] = lambda _n: None,
    ) -> torch.Tensor:
        """Token counts of about n_tokens tokens from every part of the split: the split is
        cut into about _SAMPLE_CHUNKS chunks across all of its files (by size), and the sample
        takes a document from each chunk in turn, round after round, visiting the chunks in an
        order that spreads any prefix of it evenly. Not a prefix of the
        stream, which would see one shard only."""
        if self._meta is None or self.tokenizer is None:
            raise MetaError("TextLMProvider: set_meta() must run before the corpus is sampled")
        raw = self._meta["text_lm"]["boundary"]
        boundary = None if raw is None else Boundary(int(raw[0]), int(raw[1]))
        ranges = split_ranges(self.files, boundary)
        if split not in ranges:
            raise MetaError(f"text_lm has no split {split!r}; it has {sorted(ranges)}")
        chunks = make_chunks(self.files, ranges[split], max(1, _SAMPLE_CHUNKS // CHUNKS_PER_WORKER))
        # Chunks in bit-reversed order: any first k of them are spread evenly over the split.
        bits = max(1, (len(chunks) - 1).bit_length())
        order = sorted(range(len(chunks)), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
        readers = [
            iter_docs(self.files[chunks[i].file], chunks[i].start, chunks[i].end, self.opts)
            for i in order
        ]
        counts = np.zeros(vocab_size, np.int64)
        taken = 0
        while readers and taken < n_tokens:
            alive = []
            for reader in readers:
                doc = next(reader, None)
                if doc is None:
                    continue
                alive.append(reader)
                ids, _ = self.tokenizer.encode_docs([doc[1]])
                counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
                taken += len(ids)
                progress(len(ids))
                if taken >= n_tokens:
                    break
            readers = alive
        return torch.from_numpy(counts)

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self, split: str) -> dict[str, Any]:
        return self._stream(split).state_dict()

    def load_state_dict(self, split: str, state: Mapping[str, Any]) -> None:
        self._stream(split).load_state_dict(state)


def _layout(info: Mapping[str, Any], tokenizer_sha: str, cfg: StreamConfig) -> str:
    """A short digest of everything a journaled position depends on."""
    parts: Sequence[Any] = (
        info["corpus_digest"],
        info["boundary"],
        tokenizer_sha,
        cfg.split,
        cfg.seq_len,
        cfg.packing,
        cfg.block_docs,
        cfg.shuffle,
        cfg.seed,
        cfg.worker_index,
        cfg.num_workers,
    )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
