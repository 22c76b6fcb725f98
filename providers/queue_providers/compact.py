"""Schema fields with compact storage, as the built-in providers declare them in their meta.

A batch file stores token ids in the narrowest unsigned dtype that holds the vocabulary,
labels that may be -100 in the narrowest signed one, x and y of an LM as one window of T+1
tokens, and no field that the others determine (queue_client/format/storage.py serves them). What
get_batch hands the trainer keeps the served dtype of each field; only the bytes on disk, in
the page cache and on the way to a GPU shrink.
"""

from __future__ import annotations

from typing import Any

from queue_client.format.schema import (
    AFTER_FIRST,
    LENGTH_MASK,
    NEXT_TOKEN,
    NOT_EQUAL,
    SEGMENTS,
    WINDOW,
    signed_dtype_name,
    token_dtype_name,
    unsigned_dtype_name,
)

# The stored tensor that holds an LM's windows of T+1 tokens.
WINDOW_TENSOR = "tokens"


def _field(name: str, dtype: str, shape: list[int], role: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape, "role": role, **extra}


def lm_window_schema(block_size: int, vocab_size: int) -> list[dict[str, Any]]:
    """x and y (int64 [T]) as the views w[:-1] and w[1:] of one stored window of T+1 ids."""
    stored = token_dtype_name(vocab_size)
    return [
        _field(
            "x", "int64", [block_size], "input", stored_dtype=stored,
            storage={"kind": WINDOW, "source": WINDOW_TENSOR, "offset": 0},
        ),
        _field(
            "y", "int64", [block_size], "target", stored_dtype=stored,
            storage={"kind": WINDOW, "source": WINDOW_TENSOR, "offset": 1},
        ),
    ]  # fmt: skip


def token_ids(
    name: str, shape: list[int], vocab_size: int, *, dtype: str = "int64", role: str = "input"
) -> dict[str, Any]:
    """Token ids stored as themselves, in the narrowest unsigned dtype for the vocabulary."""
    return _field(name, dtype, shape, role, stored_dtype=token_dtype_name(vocab_size))


def labels(
    name: str, shape: list[int], bound: int, *, ignore: int = -100, dtype: str = "int64"
) -> dict[str, Any]:
    """Ids below `bound`, or `ignore`, stored in the narrowest signed dtype holding both."""
    stored = signed_dtype_name(min(ignore, 0), bound - 1)
    return _field(name, dtype, shape, "target", stored_dtype=stored)


def class_ids(name: str, shape: list[int], bound: int, *, dtype: str = "int64") -> dict[str, Any]:
    """Class ids below `bound`, stored in the narrowest unsigned dtype holding them."""
    return _field(name, dtype, shape, "target", stored_dtype=unsigned_dtype_name(bound - 1))


def pad_mask(
    name: str, shape: list[int], ids: str, pad_id: int, *, dtype: str = "int64"
) -> dict[str, Any]:
    """1 where field `ids` holds anything but the pad id: derived, nothing stored."""
    return _field(
        name, dtype, shape, "mask", storage={"kind": NOT_EQUAL, "source": ids, "value": pad_id}
    )


def second_segment(
    name: str, shape: list[int], ids: str, sep_id: int, pad_id: int, *, dtype: str = "int64"
) -> dict[str, Any]:
    """token_type_ids of a [CLS] a [SEP] b [SEP] row: 1 after the first [SEP] up to the
    padding, 0 elsewhere; derived, nothing stored."""
    return _field(
        name, dtype, shape, "input",
        storage={"kind": AFTER_FIRST, "source": ids, "value": sep_id, "pad": pad_id},
    )  # fmt: skip


def packed_lm_schema(
    shape: list[int], vocab_size: int, *, eos_id: int, ignore: int, padded: bool
) -> list[dict[str, Any]]:
    """text_lm's four fields from one stored window of T+1 ids per row: input_ids = w[:-1];
    labels = w[1:] with `ignore` where a document ends (the end-of-document id, bar the few
    positions listed per batch in `eos_exceptions`) and on padding; segment_ids and
    attention_mask from those ends and, when `padded`, each row's stored length."""
    stored = token_dtype_name(vocab_size)
    docs = {
        "ids": "input_ids",
        "value": eos_id,
        "exceptions": "eos_exceptions",
        **({"lengths": "lengths"} if padded else {}),
    }
    return [
        _field(
            "input_ids", "int32", shape, "input", stored_dtype=stored,
            storage={"kind": WINDOW, "source": WINDOW_TENSOR, "offset": 0},
        ),
        _field(
            "labels", "int32", shape, "target", stored_dtype=stored,
            storage={
                "kind": NEXT_TOKEN, "source": WINDOW_TENSOR, "offset": 1, "ignore": ignore,
                **docs,
            },
        ),
        _field("attention_mask", "bool", shape, "mask", storage={"kind": LENGTH_MASK, **docs}),
        _field("segment_ids", "int32", shape, "", storage={"kind": SEGMENTS, **docs}),
    ]  # fmt: skip
