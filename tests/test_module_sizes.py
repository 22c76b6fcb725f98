"""Small modules with one job each: no module of the client, the server or the providers is
longer than MAX_LINES. One that grows past it is split by job (docs/architecture.md lists
which module owns which), never squeezed. Generated gRPC stubs are not ours to split."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("client", "server", "providers")
MAX_LINES = 400
GENERATED = "*_pb2*.py"


def too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py module under root's source folders longer than `limit` lines, with its length."""
    found = {}
    for top in SOURCE_ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            if fnmatch(path.name, GENERATED):
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_module_is_longer_than_the_limit() -> None:
    # The scan sees the tree: a wrong root would pass by finding nothing.
    assert len(list((ROOT / "server" / "queue_server").rglob("*.py"))) > 50
    offenders = too_long(ROOT)
    assert not offenders, (
        f"modules longer than {MAX_LINES} lines; move a coherent job of each into a module of "
        "its own (and list it in docs/architecture.md): "
        + ", ".join(f"{path} ({lines} lines)" for path, lines in sorted(offenders.items()))
    )


def test_the_scan_names_each_long_module_and_skips_generated_stubs(tmp_path: Path) -> None:
    def module(rel: str, lines: int) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines, encoding="utf-8")

    module("client/pkg/at_limit.py", MAX_LINES)
    module("client/pkg/wire/thing_pb2.py", MAX_LINES + 50)
    module("client/pkg/wire/thing_pb2_grpc.py", MAX_LINES + 50)
    module("server/pkg/sub/long.py", MAX_LINES + 1)
    module("providers/pkg/longer.py", MAX_LINES + 20)
    module("tests/elsewhere.py", MAX_LINES + 20)  # outside the source folders
    assert too_long(tmp_path) == {
        "server/pkg/sub/long.py": MAX_LINES + 1,
        "providers/pkg/longer.py": MAX_LINES + 20,
    }
