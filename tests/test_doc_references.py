"""Every test the documents cite exists: docs/guarantees.md and the pages beside it name the
test that shows each promise (`tests/FILE.py::NAME`), and a promise whose test was renamed
or removed would point at nothing while reading as proven."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
CITED_FILE = re.compile(r"`(tests/[\w/]+\.py)`")


def documents() -> list[Path]:
    found = sorted((ROOT / "docs").rglob("*.md"))
    found += [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    found += sorted((ROOT / "client").rglob("*.md"))
    return found


def missing(text: str) -> list[str]:
    """The cited tests (and test files) of `text` that the tree does not hold."""
    out = []
    for file, name in CITED_TEST.findall(text):
        path = ROOT / file
        if not path.is_file():
            out.append(f"{file} (no such file)")
        elif not re.search(rf"^(async )?def {name}\(", path.read_text(), re.MULTILINE):
            out.append(f"{file}::{name}")
    out += [f"{f} (no such file)" for f in CITED_FILE.findall(text) if not (ROOT / f).is_file()]
    return out


def test_every_cited_test_exists() -> None:
    cited = sum(len(CITED_TEST.findall(p.read_text())) for p in documents())
    assert cited > 100  # the scan reads the documents: a wrong root would find nothing
    gone = {str(p.relative_to(ROOT)): missing(p.read_text()) for p in documents()}
    gone = {doc: names for doc, names in gone.items() if names}
    assert not gone, f"documents cite tests that do not exist: {gone}"


def test_a_renamed_test_is_caught() -> None:
    text = "shown by `tests/test_doc_references.py::test_every_cited_test_exists` and " + (
        "`tests/test_doc_references.py::test_no_longer_here`, `tests/test_gone.py`"
    )
    assert missing(text) == [
        "tests/test_doc_references.py::test_no_longer_here",
        "tests/test_gone.py (no such file)",
    ]
