"""A tiktoken Encoding behind text_lm's tokenizer interface (tokenizer.TextTokenizer).

Documents are encoded as ordinary text: a special token's text inside a document ("<|endoftext|>"
typed into a web page) is encoded as the characters it is, so data can never forge an EOS;
text_lm appends the real EOS itself. Each document goes straight to a numpy array
(`encode_to_numpy`), never a Python list of ids, and the documents of a block are spread over
a few threads (tiktoken releases the GIL while it encodes): RAYON_NUM_THREADS, the knob that
sizes the `tokenizers` pool, sizes this one too, so one setting governs every tokenizer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from queue_client.errors import ConfigError

# Tried in order when eos_token is not given (the same list as the Hugging Face kind's).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
# Fewer documents than this per thread are not worth a hand-off.
_DOCS_PER_THREAD = 16


def encode_threads() -> int:
    """Threads per worker process: $RAYON_NUM_THREADS, else the CPUs this process may use."""
    raw = os.environ.get("RAYON_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class TiktokenTokenizer:
    kind = "tiktoken"

    def __init__(
        self,
        name: str,
        *,
        pat_str: str,
        mergeable_ranks: dict[bytes, int],
        special_tokens: Mapping[str, int],
        eos_token: str | None = None,
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(
                "tiktoken tokenizers need the tiktoken package: pip install 'batchqueue[hf]'"
            ) from None
        if eos_token is None:
            eos_token = next((t for t in EOS_CANDIDATES if t in special_tokens), None)
            if eos_token is None:
                raise ConfigError(
                    f"tiktoken encoding {name!r} has none of the usual end-of-text tokens "
                    f"{list(EOS_CANDIDATES)}; set eos_token to one of {sorted(special_tokens)}"
                )
        if eos_token not in special_tokens:
            raise ConfigError(
                f"eos_token {eos_token!r} is not a special token of tiktoken encoding {name!r}; "
                f"it has {sorted(special_tokens)}"
            )
        taken = set(mergeable_ranks.values())
        clash = sorted(t for t, i in special_tokens.items() if i in taken)
        if clash:
            raise ConfigError(
                f"tiktoken encoding {name!r}: special token(s) {clash} reuse an id of a token"
            )
        try:
            self._enc = tiktoken.Encoding(
                name,
                pat_str=pat_str,
                mergeable_ranks=mergeable_ranks,
                special_tokens=dict(special_tokens),
            )
        except Exception as exc:  # a bad regex, from the Rust core
            raise ConfigError(f"tiktoken encoding {name!r} does not build: {exc}") from None
        self.name = name
        self.pat_str = pat_str
        self.special_tokens = dict(special_tokens)
        self.eos_token = eos_token
        self.eos_id = int(special_tokens[eos_token])
        self.pad_id = self.eos_id
        self.vocab_size = int(self._enc.n_vocab)
        self._threads = encode_threads()
        self._pool: ThreadPoolExecutor | None = None

    def _encode_one(self, text: str) -> np.ndarray:
        try:
            return self._enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: encode what Python would print
            fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self._enc.encode_to_numpy(fixed, disallowed_special=())

    def _encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self._encode_one(t) for t in texts]

    def encode_docs(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        threads = min(self._threads, len(texts) // _DOCS_PER_THREAD)
        if threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tiktoken")
            step = -(-len(texts) // threads)
            parts = [texts[i : i + step] for i in range(0, len(texts), step)]
            arrays = [a for part in self._pool.map(self._encode_many, parts) for a in part]
        else:
            arrays = [self._encode_one(t) for t in texts]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)) + 1
        flat = np.empty(int(lengths.sum()), dtype=np.int32)
        ends = np.cumsum(lengths)
        # One EOS after each document; the documents' ids fill the positions in between.
        flat[ends - 1] = self.eos_id
        if arrays:
            body = np.ones(len(flat), dtype=bool)
            body[ends - 1] = False
            flat[body] = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        return flat, lengths

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        known = [i for i in np.asarray(ids).tolist() if 0 <= i < self.vocab_size]
        try:
            return self._enc.decode_bytes(known).decode("utf-8", errors="replace")
        except KeyError:  # an id in a gap of the vocabulary: decode the others
            pieces = []
            for i in known:
                with contextlib.suppress(KeyError):
                    pieces.append(self._enc.decode_single_token_bytes(i))
            return b"".join(pieces).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "eos_token": self.eos_token,
            "special_tokens": dict(self.special_tokens),
        }
