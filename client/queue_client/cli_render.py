"""The terminal (rich) view of `queue-client` stats, meta, schema and explain, split out of cli.py.

Off a terminal (stdout a pipe or a file) the tables are plain: no box, no colour, and as wide
as their columns, never cut to a terminal's width ("back...") that the reader does not have.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from queue_client import errors
from queue_client.mixture import describe_stats

# Off a terminal: wide enough that no table is cut or wrapped; each is as wide as its columns.
PLAIN_WIDTH = 10_000


def _plain() -> bool:
    return not sys.stdout.isatty()


def console() -> Any:
    """The rich Console the views print to: full width off a terminal, the terminal's on one."""
    try:
        from rich.console import Console
    except ImportError:
        raise errors.BatchQueueError(
            "the terminal view needs rich (pip install rich); --json works without it"
        ) from None
    return Console(width=PLAIN_WIDTH) if _plain() else Console()


def _table(**options: Any) -> Any:
    """A rich Table, drawn without a box off a terminal."""
    from rich.table import Table

    return Table(box=None, pad_edge=False, **options) if _plain() else Table(**options)


def _rate_text(value: float | None) -> str:
    return "(-/s)" if value is None else f"({value:.1f}/s)"


def _si(value: float) -> str:
    """1234567 -> '1.23M': rates and counts at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _duration(value_s: float) -> str:
    seconds = round(value_s)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _epoch_text(split: dict[str, Any]) -> str:
    """'2.37 (ETA 4m05s)', or 'unknown' when the provider gives no epoch size."""
    epochs = split.get("epochs")
    if epochs is None:
        return "unknown"
    eta = split.get("epoch_eta_s")
    return f"{epochs:.2f}" + ("" if eta is None else f" (ETA {_duration(eta)})")


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.0f} MiB" if value else "?"


def _worker_text(w: dict[str, Any]) -> str:
    """One worker as the stats table's workers line names it: what it is, where it runs."""
    what = f"{w['role']} {w['index']}"
    if w["backend"] != "ray":
        return f"{what} pid {w['pid'] or '-'} {_mib(w['rss_bytes'])}"
    where = f"{what} on Ray node {w['node_id'][:8] or '?'} pid {w['pid'] or '-'}"
    return where + (f" (restarted {w['restarts']}x)" if w["restarts"] else "")


def _bar(value: int, limit: int, width: int = 8) -> str:
    filled = min(width, round(width * value / limit)) if limit > 0 else 0
    return f"{value}/{limit} " + "█" * filled + "░" * (width - filled)


def render_stats(doc: dict[str, Any]) -> Any:
    """GetStats' document: per dataset a table of its splits and one of its ranks, then its
    curriculum, mixture, worker and warning lines."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [Text(f"batchqueue at {doc['address']}", style="bold")]
    for ds in doc["datasets"]:
        state_style = {"serving": "green", "starting": "yellow"}.get(ds["state"], "red")
        splits = _table(
            title=Text.assemble(ds["dataset"], " ", (ds["state"], state_style)),
            title_justify="left",
        )
        columns = ("split", "backlog", "produced", "regenerated", "consumed", "tokens/s",
                   "batches/s", "epochs", "leased", "quarantined")  # fmt: skip
        for col in columns:
            splits.add_column(col, justify="left" if col in ("split", "backlog") else "right")
        ranks = _table(title=f"{ds['dataset']}: ranks", title_justify="left")
        for col in ("split", "rank", "leased", "backlog", "lag (files)", "last consumed seq"):
            ranks.add_column(col, justify="left" if col == "split" else "right")
        notes = [ds["last_error"]]
        curricula: list[str] = []
        workers: list[str] = []
        for s in ds["splits"]:
            splits.add_row(
                s["split"], _bar(s["backlog_files"], s["backlog_limit"]), f"{s['produced_files']} {_rate_text(s['produced_per_s'])}",
                str(s["reproduced_files"]), str(s["consumed_files"]), _si(s["tokens_per_s"]), f"{s['batches_per_s']:.1f}",
                _epoch_text(s), str(s["leased_files"]), str(s["quarantined_files"]),
            )  # fmt: skip
            for r in s["ranks"]:
                ranks.add_row(
                    s["split"],
                    str(r["rank"]),
                    str(r["files_leased"]),
                    str(r["ready_files"]),
                    str(r["lag_files"]),
                    str(r["last_consumed_seq"]),
                )
            if s.get("workers"):
                places = ", ".join(_worker_text(w) for w in s["workers"])
                workers.append(f"{s['split']} workers: {places}")
            notes.extend(f"{s['split']}: {w}" for w in s["warnings"])
            if s["worker_restarts"]:
                notes.append(f"{s['split']}: {s['worker_restarts']} worker restart(s)")
            if s["last_disk_error"]:
                notes.append(f"{s['split']}: {s['last_disk_error']}")
            cur = s.get("curriculum")
            if cur:
                curricula.append(
                    f"{s['split']}: curriculum alpha {cur['alpha']:.3f}, KL to target "
                    f"{cur['kl_to_target']:.4f} nats, buffer {cur['buffer_batches']} batches, "
                    f"{cur['candidate_files']} candidate files"
                )
            if s.get("mixture"):
                curricula.extend(describe_stats(s["split"], s["mixture"]))
        parts += [splits, ranks]
        parts += [Text(line) for line in curricula + workers]
        parts += [Text(note, style="red") for note in notes if note]
    if doc.get("error"):
        parts.append(Text(f"{doc['error']} (retrying)", style="red"))
    return Group(*parts)


def _short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_meta(doc: dict[str, Any]) -> Any:
    """GetMeta's document as key/value rows, long values shortened."""
    table = _table(title=f"{doc['dataset']}: meta", title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in doc.items():
        if key != "meta":
            table.add_row(key, _short(value))
    for key, value in sorted(doc["meta"].items()):
        table.add_row(f"meta.{key}", _short(value))
    return table


def render_schema(doc: dict[str, Any]) -> Any:
    """GetSchema's document as one table of fields per split."""
    from rich.console import Group

    tables = []
    for split, info in doc["splits"].items():
        table = _table(
            title=f"{doc['dataset']}/{split}: batches of {info['batch_size']}", title_justify="left"
        )
        for col in ("field", "dtype", "shape (one sample)", "role"):
            table.add_column(col)
        for f in info["fields"]:
            table.add_row(f["name"], f["dtype"], str(tuple(f["shape"])), f["role"])
        tables.append(table)
    return Group(*tables)


def render_explain(doc: dict[str, Any]) -> Any:
    """One line per row of the step: its batch file and row, source, input file, token
    offset and document ("-" where unknown)."""
    where = f"step {doc['step']} of rank {doc['rank']}" if doc["step"] is not None else "rows"
    table = _table(
        title=f"{doc['dataset']} {doc['split']}: {where} (world size {doc['world_size']})"
    )
    for name in ("seq", "row", "source", "file", "token offset", "document"):
        table.add_column(name, justify="left" if name in ("source", "file") else "right")
    for r in doc["rows"]:
        document = str(r["document"]) if r["document"] >= 0 else "-"
        table.add_row(
            str(r["seq"]),
            str(r["row"]),
            r["source"] or "-",
            r["file"],
            str(r["token_offset"]),
            document,
        )
    return table
