"""The one table the suite prints, its notes, and the JSON file with the same figures."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import Result, fmt


def machine() -> dict[str, Any]:
    import grpc
    import numpy
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _ids(results: list[Result]) -> list[str]:
    """1a, 1b, 2a, ...: one id per printed row, used by the notes."""
    seen: dict[str, int] = {}
    out = []
    for r in results:
        seen[r.row] = seen.get(r.row, 0) + 1
        out.append(f"{r.row}{chr(ord('a') + seen[r.row] - 1)}")
    return out


def _cells(r: Result) -> list[str]:
    if r.skipped:
        return [r.case, "skipped", "", "", "", "", ""]
    value = f"{fmt(r.value)} {r.unit}" if r.value is not None else "ERROR"
    ref = f"{fmt(r.ref_value)} {r.ref_unit}" if r.ref_value is not None else ""
    ratio = f"{fmt(r.ratio)}{r.ratio_label}" if r.ratio is not None else ""
    met = "" if r.met is None else ("yes" if r.met else "NO")
    return [r.case, value, r.ref_name, ref, ratio, r.goal, met]


def table(results: list[Result], meta: dict[str, Any]) -> str:
    head = ["id", "case", "batchqueue", "vs", "reference", "ratio", "goal", "met"]
    ids = _ids(results)
    rows = [[i, *_cells(r)] for i, r in zip(ids, results, strict=True)]
    widths = [max(len(str(row[c])) for row in [head, *rows]) for c in range(len(head))]
    right = {2, 4, 5}

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if k in right else str(c).ljust(w)
            for k, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [
        f"batchqueue benchmarks, {meta['date']}: {meta['cpu_count']} cores ({meta['processor']}), "
        f"torch {meta['torch']}, grpcio {meta['grpcio']}, python {meta['python']}; text: {meta['text']}"
        + (
            f"; load average {meta['load_at_start']:.1f} at start, {meta['load_average_1min']:.1f} at end"
            if meta.get("load_at_start") is not None
            else ""
        )
        + ("; QUICK (smoke) run: figures are not meaningful" if meta.get("quick") else ""),
        "",
        line(head),
        line(["-" * w for w in widths]),
        *(line(r) for r in rows),
    ]
    notes = [f"  {i}: {r.note}" for i, r in zip(ids, results, strict=True) if r.note]
    if notes:
        out += ["", "notes:", *notes]
    out.append(f"\n{meta['elapsed_s']:.0f} s in all")
    return "\n".join(out)


def write_json(path: Path, results: list[Result], meta: dict[str, Any]) -> None:
    ids = _ids(results)
    payload = {
        "meta": meta,
        "results": [{"id": i, **asdict(r)} for i, r in zip(ids, results, strict=True)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str, allow_nan=True), encoding="utf-8")


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
