"""A dataset's `sources` tables, turned into the args of the `mixture` provider.

    [datasets.mix]                       # batch_size, batches_per_file, seed... as always
    batch_size = 8
    mixture_schedule = [[1_000_000, { web = 0.2, code = 0.8 }]]   # [tokens, weights]
    [datasets.mix.sources.web]
    provider = "nanogpt_bin"
    weight = 0.7
    [datasets.mix.sources.web.args]
    data_dir = "data/web"

Sources keep their TOML order: source i is the i-th table, and `source` = i in each row.
"""

from __future__ import annotations

import re
from typing import Any

from queue_client.errors import ConfigError
from queue_client.mixture import check_weights

MIXTURE_PROVIDER = "mixture"
# TOML keys of a dataset's table that belong to its mixture.
MIXTURE_KEYS = {"sources", "mixture_schedule", "mixture_schedule_unit"}
SCHEDULE_UNITS = ("tokens",)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SOURCE_KEYS = {"provider", "args", "weight"}


def is_mixture(provider: str) -> bool:
    return provider == MIXTURE_PROVIDER


def take_mixture(table: dict[str, Any], where: str) -> None:
    """Replace a table's mixture keys by provider = "mixture" and its args, in place."""
    if table.get("provider") == MIXTURE_PROVIDER:
        if "sources" in table:
            raise ConfigError(
                f'{where}.provider = "{MIXTURE_PROVIDER}": remove this line: the '
                f"[{where}.sources.NAME] tables make {where} a mixture already, and each "
                "source names its own provider"
            )
        raise ConfigError(
            f'{where}.provider = "{MIXTURE_PROVIDER}": write the sources as '
            f"[{where}.sources.NAME] tables (provider, weight, args) instead"
        )
    if not MIXTURE_KEYS & set(table):
        return
    if "sources" not in table:
        raise ConfigError(f"{where}: mixture_schedule needs [{where}.sources.NAME] tables")
    for key in ("provider", "args"):
        if key in table:
            raise ConfigError(
                f"{where}.{key}: a dataset with sources takes its provider and args from each "
                f"[{where}.sources.NAME] table; remove {key} here"
            )
    if table.get("selection", "fifo") != "fifo":
        raise ConfigError(
            f"{where}.selection = {table['selection']!r}: curriculum selection does not work "
            "with a mixture yet (it picks batches, a mixture fixes each row's source); use one"
        )
    sources = _sources(table.pop("sources"), where)
    names = [s["name"] for s in sources]
    unit = table.pop("mixture_schedule_unit", "tokens")
    if unit not in SCHEDULE_UNITS:
        raise ConfigError(
            f"{where}.mixture_schedule_unit = {unit!r} is invalid: expected one of {SCHEDULE_UNITS}"
        )
    schedule = _schedule(table.pop("mixture_schedule", []), names, f"{where}.mixture_schedule")
    table["provider"] = MIXTURE_PROVIDER
    table["args"] = {"sources": sources, "schedule": schedule, "schedule_unit": unit}


def _sources(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}.sources must hold [{where}.sources.NAME] tables")
    if len(raw) > 255:
        raise ConfigError(f"{where}.sources holds {len(raw)} sources; at most 255")
    out = []
    for name, spec in raw.items():
        key = f"{where}.sources.{name}"
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{key}: the source name must be letters, digits, _ . -")
        if not isinstance(spec, dict):
            raise ConfigError(f"{key} must be a table with provider, weight and args")
        unknown = sorted(set(spec) - _SOURCE_KEYS)
        if unknown:
            raise ConfigError(f"{key}: unknown key(s) {unknown}: expected {sorted(_SOURCE_KEYS)}")
        if not isinstance(spec.get("provider"), str) or not spec["provider"]:
            raise ConfigError(f"{key}.provider is missing: name the source's provider")
        if spec["provider"] == MIXTURE_PROVIDER:
            raise ConfigError(f"{key}.provider: a source cannot be a mixture itself")
        args = spec.get("args", {})
        if not isinstance(args, dict):
            raise ConfigError(f"{key}.args = {args!r} is invalid: expected a table")
        out.append({"name": name, "provider": spec["provider"], "args": args,
                    "weight": spec.get("weight", 1.0)})  # fmt: skip
    try:
        check_weights(
            {s["name"]: s["weight"] for s in out}, [s["name"] for s in out], f"{where}.sources"
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return out


def _schedule(raw: Any, names: list[str], where: str) -> list[list[Any]]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where} = {raw!r} is invalid: expected a list of [tokens, weights]")
    out: list[list[Any]] = []
    for i, point in enumerate(raw):
        ok = (
            isinstance(point, list)
            and len(point) == 2
            and isinstance(point[0], int)
            and not isinstance(point[0], bool)
            and point[0] >= 0
            and isinstance(point[1], dict)
        )
        if not ok:
            raise ConfigError(
                f"{where}[{i}] = {point!r} is invalid: expected [tokens, {{name = weight}}]"
            )
        if out and point[0] <= out[-1][0]:
            raise ConfigError(f"{where}[{i}]: the points' tokens must increase")
        try:
            weights = check_weights(point[1], names, f"{where}[{i}]")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        out.append([point[0], weights])
    return out
