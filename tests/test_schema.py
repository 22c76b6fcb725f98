"""The batch schema: field validation, parsing, and checking tensors against it."""

from __future__ import annotations

import pytest
import torch

from queue_client.errors import MetaError, SchemaMismatch
from queue_client.format.schema import (
    DTYPES,
    FieldSpec,
    check_tensors,
    dtype_name,
    is_xy,
    parse_schema,
    torch_dtype,
)

SCHEMA = (
    FieldSpec("x", "int64", (4,), "input"),
    FieldSpec("mask", "bool", (4,), "mask"),
    FieldSpec("label", "float32", ()),
)


def _batch(lead: tuple[int, ...] = (2,)) -> dict[str, torch.Tensor]:
    return {
        "x": torch.zeros((*lead, 4), dtype=torch.int64),
        "mask": torch.ones((*lead, 4), dtype=torch.bool),
        "label": torch.zeros(lead, dtype=torch.float32),
    }


# ---- FieldSpec ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "1x", "a-b", "a b", "x.y", None, 3])
def test_field_name_must_be_identifier(name: object) -> None:
    """A field name that is not a Python identifier is refused, naming it."""
    with pytest.raises(MetaError, match="identifier") as info:
        FieldSpec(name, "int64", (1,))  # type: ignore[arg-type]
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("shape", [(0,), (-1,), (4, 0), (2.0,), ("3",), (True, 0)])
def test_field_shape_must_be_positive_ints_naming_field(shape: tuple) -> None:
    """Zero, negative or non-int dimensions are refused; the message names the field."""
    with pytest.raises(MetaError, match="'tokens'") as info:
        FieldSpec("tokens", "int64", shape)
    assert "shape" in str(info.value)


def test_field_role_must_be_known_naming_field() -> None:
    """An unknown role is refused, naming the field and the role."""
    with pytest.raises(MetaError, match="'tokens'") as info:
        FieldSpec("tokens", "int64", (2,), role="label")
    assert "'label'" in str(info.value)


@pytest.mark.parametrize("dtype", ["int65", "long", "torch.int64", "", "float"])
def test_field_dtype_must_be_known(dtype: str) -> None:
    """An unknown dtype is refused, naming the dtype."""
    with pytest.raises(MetaError, match="unknown dtype") as info:
        FieldSpec("tokens", dtype, (2,))
    assert repr(dtype) in str(info.value)


def test_field_dtype_error_names_the_field() -> None:
    """A bad dtype's error names the field it belongs to."""
    with pytest.raises(MetaError, match="'tokens'"):
        FieldSpec("tokens", "int65", (2,))


@pytest.mark.parametrize("role", ["", "input", "target", "mask"])
def test_valid_field_specs(role: str) -> None:
    """Every known role is accepted, and an empty shape means a scalar per sample."""
    spec = FieldSpec("f", "bfloat16", (), role)
    assert spec.shape == ()
    assert spec.role == role


def test_from_dict_to_dict_round_trip() -> None:
    """from_dict and to_dict are inverses; a missing role defaults to ''."""
    raw = {"name": "x", "dtype": "int32", "shape": [3, 5], "role": "input"}
    spec = FieldSpec.from_dict(raw)
    assert spec == FieldSpec("x", "int32", (3, 5), "input")
    assert spec.to_dict() == raw
    assert FieldSpec.from_dict({"name": "y", "dtype": "int64", "shape": [1]}).role == ""
    assert (
        FieldSpec.from_dict({"name": "y", "dtype": "int64", "shape": [1], "role": None}).role == ""
    )


def test_from_dict_names_missing_keys() -> None:
    """A field dict lacking keys names every missing one and shows the field."""
    with pytest.raises(MetaError) as info:
        FieldSpec.from_dict({"name": "x"})
    message = str(info.value)
    assert "'dtype'" in message and "'shape'" in message and "'x'" in message


def test_parse_schema_rejects_empty_and_duplicates() -> None:
    """A schema must be a non-empty list with unique field names."""
    with pytest.raises(MetaError, match="non-empty"):
        parse_schema([])
    with pytest.raises(MetaError, match="non-empty"):
        parse_schema({"name": "x"})  # type: ignore[arg-type]
    with pytest.raises(MetaError, match="repeats"):
        parse_schema([{"name": "x", "dtype": "int64", "shape": [1]}] * 2)


def test_dtype_names_map_to_torch_and_back() -> None:
    """Every schema dtype name is a torch dtype whose name maps back to it."""
    for name in DTYPES:
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(MetaError):
        torch_dtype("Tensor")


# ---- check_tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(2,), (3, 2)])
def test_check_tensors_accepts_matching_batch(lead: tuple[int, ...]) -> None:
    """A batch (or a whole file, with a two-axis lead) matching the schema passes."""
    check_tensors(SCHEMA, _batch(lead), lead)


def test_check_tensors_missing_field() -> None:
    """A missing field raises SchemaMismatch naming it."""
    batch = _batch()
    del batch["mask"]
    with pytest.raises(SchemaMismatch, match="'mask'"):
        check_tensors(SCHEMA, batch, (2,))


def test_check_tensors_extra_field() -> None:
    """A field the schema lacks raises SchemaMismatch naming it."""
    batch = _batch()
    batch["surprise"] = torch.zeros(2)
    with pytest.raises(SchemaMismatch, match="surprise"):
        check_tensors(SCHEMA, batch, (2,))


@pytest.mark.parametrize(
    ("field", "wrong"),
    [("x", torch.int32), ("mask", torch.uint8), ("label", torch.float64)],
)
def test_check_tensors_wrong_dtype(field: str, wrong: torch.dtype) -> None:
    """A wrong dtype raises SchemaMismatch naming the field and both dtypes."""
    batch = _batch()
    batch[field] = batch[field].to(wrong)
    with pytest.raises(SchemaMismatch, match=f"'{field}'") as info:
        check_tensors(SCHEMA, batch, (2,))
    message = str(info.value)
    assert dtype_name(wrong) in message
    assert next(f.dtype for f in SCHEMA if f.name == field) in message


@pytest.mark.parametrize(
    ("field", "shape"),
    [("x", (2, 5)), ("x", (3, 4)), ("x", (2, 4, 1)), ("label", (2, 1)), ("mask", (4,))],
)
def test_check_tensors_wrong_shape(field: str, shape: tuple[int, ...]) -> None:
    """A wrong shape (sample or batch axis) raises SchemaMismatch naming the field and shapes."""
    batch = _batch()
    batch[field] = torch.zeros(shape, dtype=batch[field].dtype)
    with pytest.raises(SchemaMismatch, match=f"'{field}'") as info:
        check_tensors(SCHEMA, batch, (2,))
    assert str(shape) in str(info.value)


def test_check_tensors_non_tensor() -> None:
    """A value that is not a tensor raises SchemaMismatch naming the field."""
    batch: dict = _batch()
    batch["x"] = [[0] * 4] * 2
    with pytest.raises(SchemaMismatch, match="'x'"):
        check_tensors(SCHEMA, batch, (2,))


# ---- is_xy --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["x", "y"], True),
        (["y", "x"], False),
        (["x"], False),
        (["x", "y", "mask"], False),
        (["input_ids", "labels"], False),
    ],
)
def test_is_xy(names: list[str], expected: bool) -> None:
    """Only a schema of exactly x then y is served as an (X, Y) tuple."""
    assert is_xy([FieldSpec(n, "int64", (1,)) for n in names]) is expected
