"""docs/config-reference.md stays true: every config key with its type and default, and
nothing documented that the config schema (ServerConfig, DatasetConfig) lacks."""

from __future__ import annotations

import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from queue_client.errors import ConfigError
from queue_server.config import DatasetConfig, ServerConfig, parse_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOC = ROOT / "docs" / "config-reference.md"
SERVER, DATASET, NOT_KEYS = "[server]", "[datasets.NAME]", "Schema fields that are not keys"
# A field's annotation, as written in config.py, and the type the reference gives (TOML's words).
DOC_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "Path": "string (path)",
    "str | None": "string",
    "dict[str, Any]": "table",
    "list[list[float]]": "array of [number, number]",
    "list[str]": "array of strings",
}
REQUIRED = object()


def sections() -> dict[str, list[list[str]]]:
    """The table rows under each '## ' heading (backticks stripped from it), header row dropped."""
    out: dict[str, list[list[str]]] = {}
    heading = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = line[3:].strip().strip("`")
            out[heading] = []
        elif line.startswith("|") and heading and not set(line) <= set("|-: "):
            out[heading].append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return {h: rows[1:] for h, rows in out.items()}


def key_rows(section: str) -> dict[str, list[str]]:
    rows = sections()[section]
    assert rows, f"{DOC.name} has no table under '## `{section}`'"
    out: dict[str, list[str]] = {}
    for row in rows:
        assert len(row) >= 4 and row[0].startswith("`") and row[0].endswith("`"), (
            f"malformed row {row} under {section}"
        )
        key = row[0].strip("`")
        assert key not in out, f"{section}: `{key}` is documented twice"
        out[key] = row
    return out


def not_keys(cls: type) -> set[str]:
    """Fields the reference lists as set some other way than by a key of their table."""
    names = {row[0].strip("`") for row in sections()[NOT_KEYS]}
    return {n.partition(".")[2] for n in names if n.startswith(f"{cls.__name__}.")}


def expected_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return str(f.default) if isinstance(f.default, Path) else f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return REQUIRED


def documented_default(cell: str) -> Any:
    if cell == "required":
        return REQUIRED
    if cell == "unset":
        return None
    assert cell.startswith("`") and cell.endswith("`"), (
        f"default {cell!r} is not a `TOML value`, 'required' or 'unset'"
    )
    return tomllib.loads(f"v = {cell.strip('`')}")["v"]


CASES = [(ServerConfig, SERVER), (DatasetConfig, DATASET)]


@pytest.mark.parametrize(("cls", "section"), CASES)
def test_every_field_is_documented_and_nothing_else(cls: type, section: str) -> None:
    names = {f.name for f in fields(cls)}
    documented, other = set(key_rows(section)), not_keys(cls)
    assert not (other - names), (
        f"{DOC.name} lists {sorted(other - names)} as {cls.__name__} fields; there are none"
    )
    assert not (documented - names), (
        f"{DOC.name} documents {sorted(documented - names)} under {section}; {cls.__name__} has no such field"
    )
    missing = names - documented - other
    assert not missing, (
        f"{cls.__name__} fields {sorted(missing)} are missing from {DOC.name} under {section}"
    )
    assert not (documented & other), (
        f"{sorted(documented & other)} are documented both as keys and as not keys"
    )


@pytest.mark.parametrize(("cls", "section"), CASES)
def test_types_and_defaults_match_the_schema(cls: type, section: str) -> None:
    rows = key_rows(section)
    for f in fields(cls):
        if f.name not in rows:
            continue
        _, type_cell, default_cell, meaning = rows[f.name][:4]
        assert str(f.type) in DOC_TYPES, (
            f"{cls.__name__}.{f.name} has annotation {f.type!r}: add its TOML type to DOC_TYPES"
        )
        assert type_cell == DOC_TYPES[str(f.type)], (
            f"{section} `{f.name}`: type {type_cell!r}, the schema says {DOC_TYPES[str(f.type)]!r}"
        )
        want, have = expected_default(f), documented_default(default_cell)
        assert have == want and type(have) is type(want), (
            f"{section} `{f.name}`: default {default_cell}, the schema says {want!r}"
        )
        assert len(meaning) > 10, f"{section} `{f.name}` has no meaning"


def test_documented_keys_are_accepted_and_not_keys_refused(tmp_path: Path) -> None:
    """A config that sets every documented key to its documented default parses to those
    defaults; a schema field documented as not a key is refused as a key."""
    samples = {"string": '"x"', "integer": "4"}
    lines: list[str] = []
    for section, table in ((SERVER, "[server]"), (DATASET, "[datasets.d]")):
        lines.append(table)
        for key, row in key_rows(section).items():
            default = row[2]
            if default in ("required", "unset"):
                literal = '"char_lm"' if key == "provider" else samples[row[1]]
            else:
                literal = default.strip("`")
            lines.append(f"{key} = {literal}")
    config = parse_config(tomllib.loads("\n".join(lines)), config_dir=tmp_path)
    dataset = config.dataset("d")
    for cls, obj, section in ((ServerConfig, config, SERVER), (DatasetConfig, dataset, DATASET)):
        rows = key_rows(section)
        for f in fields(cls):
            if (
                f.name in rows
                and rows[f.name][2] not in ("required", "unset")
                and f.name != "data_root"
            ):
                assert getattr(obj, f.name) == documented_default(rows[f.name][2]), (
                    f"{section} `{f.name}`"
                )
    assert config.data_root == tmp_path / "data"  # relative to the config file's directory

    for cls, table in (
        (ServerConfig, "[server]"),
        (DatasetConfig, '[datasets.d]\nprovider = "char_lm"\nbatch_size = 4'),
    ):
        for name in not_keys(cls):
            with pytest.raises(ConfigError, match=name):
                parse_config(tomllib.loads(f"{table}\n{name} = true"), config_dir=tmp_path)
