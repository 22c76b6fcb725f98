"""The packages' import graph: no circles, and no reaching into another module's privates.

Every module of queue_client, queue_server and queue_providers is parsed with `ast` (nothing
is imported) and each of its imports becomes an arrow: module-level ones, the ones inside
functions (a deferred import is still a dependency, and moving one into a function to break
a circle hides it without untangling anything), and the ones under `if TYPE_CHECKING:`.

Why type-only imports count: a module that names another's class in its annotations is
written against that class, so an arrow from it back up is the same tangle at the level
where a reader meets it, even though Python never runs the import. The way out is the same
as for a runtime arrow: move the shared piece into a module both import, or have the lower
module say what it needs in a small Protocol that the upper one satisfies
(queue_server/steering/port.py). Module nodes are the modules themselves; importing
`a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, but that is no arrow to them
(it is how packages work, and counting it would make every re-exporting `__init__` a circle).

Private names: `_name` is private to the module that defines it. Another module may not
`from m import _name`, nor read `m._name` off an imported module. A helper that a sibling
in the same package needs is part of that package's internal API: it drops its underscore
(what users may import is the package's `__init__` and its `__all__`, not the underscore).
A private module (`pkg/_helpers.py`) is the one package-level privacy: modules inside `pkg`
may import it and its public names, modules outside may not. Dunder names (`__version__`)
are not private, and a module's own privates and `self._x` are not imports, so are fine.
A private attribute read off another module's object (`queue._journal`) is beyond this scan,
which knows no types: a Protocol of what the reader needs keeps those out (as above).

"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (source folder, package) of every package whose modules are checked.
PACKAGES = (
    ("client", "queue_client"),
    ("server", "queue_server"),
    ("providers", "queue_providers"),
)


@dataclass(frozen=True)
class Import:
    """One import statement's target in the packages: `target` is a module, and `names` the
    names it takes from it (`from target import a, b`), empty for `import target`."""

    target: str
    names: tuple[str, ...]
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def modules(root: Path) -> dict[str, Path]:
    """Every module of the packages under root, by dotted name (a package by its own name)."""
    found = {}
    for folder, package in PACKAGES:
        base = root / folder
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_package(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom, known: dict[str, Path]) -> str:
    """The absolute name `from ... import` reads from (relative imports made absolute)."""
    if not node.level:
        return node.module or ""
    package = module if _is_package(module, known) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _own(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is one of the packages' modules."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[ast.AST]:
    """The statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), nested ones too."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _dotted(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for statement in node.body:
                found.update(ast.walk(statement))
    return found


def imports(module: str, tree: ast.AST, known: dict[str, Path]) -> Iterator[Import]:
    """Each import in the module (anywhere in it) of one of the packages' modules. A `from
    pkg import sub` of a submodule is an import of that submodule, not of pkg."""
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _own(alias.name, known)
                if target is not None:
                    yield Import(target, (), node.lineno, node in type_only)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, known)
            base = _own(source, known)
            if base is None:
                continue
            taken = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    yield Import(sub, (), node.lineno, node in type_only)
                else:
                    taken.append(alias.name)
            if taken:
                yield Import(base, tuple(taken), node.lineno, node in type_only)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def all_imports(root: Path) -> dict[str, list[Import]]:
    """module -> its imports of the packages' other modules."""
    known = modules(root)
    return {
        name: [i for i in imports(name, _parse(path), known) if i.target != name]
        for name, path in known.items()
    }


def graph(root: Path) -> dict[str, set[str]]:
    """module -> the packages' modules it imports (itself left out)."""
    return {name: {i.target for i in found} for name, found in all_imports(root).items()}


def cycles(arrows: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each as its sorted module names, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(arrows):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private_module_allowed(importer: str, target: str) -> bool:
    """Whether `importer` may use module `target` given the private modules on its path:
    only from inside the package that holds each private module."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _private(part) and not _inside(importer, ".".join(parts[:i])):
            return False
    return True


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a chain of attribute reads on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def private_uses(root: Path) -> list[tuple[str, str, int]]:
    """(module, "other._name", line) for each private name a module takes from another one
    of the packages' modules: `from other import _name`, or `other._name` read off a name
    bound to the imported module `other`. Also an import of a private module from outside
    its package, as (module, "private.module", line)."""
    known = modules(root)
    found = []
    for name, path in known.items():
        tree = _parse(path)
        for imp in imports(name, tree, known):
            if not _private_module_allowed(name, imp.target):
                found.append((name, imp.target, imp.line))
            if imp.target == name:
                continue
            found.extend((name, f"{imp.target}.{n}", imp.line) for n in imp.names if _private(n))
        # Names bound to the packages' modules: `import a.b` binds `a`, `import a.b as m`
        # binds `m` to a.b, `from a import b` binds `b` to module a.b.
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        top = alias.name.partition(".")[0]
                        bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, node, known)
                for alias in node.names:
                    if f"{source}.{alias.name}" in known:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head not in bound:
                continue
            owner = f"{bound[head]}.{rest}" if rest else bound[head]
            if owner in known and owner != name:
                found.append((name, f"{owner}.{node.attr}", node.lineno))
    return sorted(set(found))


def _describe(cycle: tuple[str, ...], found: dict[str, list[Import]]) -> str:
    arrows = [
        f"{name} -> {i.target} (line {i.line}{', under TYPE_CHECKING' if i.type_only else ''})"
        for name in cycle
        for i in found[name]
        if i.target in cycle
    ]
    return " + ".join(cycle) + ":\n    " + "\n    ".join(arrows)


def test_the_packages_modules_import_in_no_circle() -> None:
    found = all_imports(ROOT)
    assert len(found) > 200  # the scan sees the tree: a wrong root would pass by finding nothing
    new = cycles(graph(ROOT))
    assert not new, (
        "import circles (move the shared piece into a module both import, or have the lower "
        "module take what it needs through a small Protocol; steering/port.py does):\n"
        + "\n".join(_describe(c, found) for c in new)
    )


def test_no_module_takes_another_modules_private_names() -> None:
    new = private_uses(ROOT)
    assert not new, (
        "private names taken from another module (make the name public in its module, or "
        "move it where both modules may use it):\n"
        + "\n".join(f"    {m} (line {line}) uses {name}" for m, name, line in new)
    )


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_scan_finds_each_kind_of_circle(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "client/queue_client/__init__.py": "from queue_client.low import Low\n",
            "client/queue_client/low.py": "from queue_client import mid\n",  # a submodule
            # A circle through an import inside a function, and one under TYPE_CHECKING.
            "client/queue_client/mid.py": "def f():\n    import queue_client.low\n",
            "server/queue_server/__init__.py": "",
            "server/queue_server/a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from queue_server.sub.b import B\n",
            "server/queue_server/sub/__init__.py": "",
            "server/queue_server/sub/b.py": "from .c import C\n",  # relative
            "server/queue_server/sub/c.py": "from .. import a\n",
            # No circle: a package's __init__ importing a module that imports its sibling.
            "providers/queue_providers/__init__.py": "from queue_providers.p import P\n",
            "providers/queue_providers/p.py": "import queue_providers.q\nimport numpy\n",
            "providers/queue_providers/q.py": "from queue_client import Low\n",
        },
    )
    assert cycles(graph(tmp_path)) == [
        ("queue_client.low", "queue_client.mid"),
        ("queue_server.a", "queue_server.sub.b", "queue_server.sub.c"),
    ]
    found = all_imports(tmp_path)
    assert _describe(("queue_client.low", "queue_client.mid"), found) == (
        "queue_client.low + queue_client.mid:\n"
        "    queue_client.low -> queue_client.mid (line 1)\n"
        "    queue_client.mid -> queue_client.low (line 2)"
    )
    assert [i.type_only for i in found["queue_server.a"]] == [True]


def test_the_scan_finds_each_private_name_taken_across_modules(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "client/queue_client/__init__.py": "__version__ = '1'\n",
            "client/queue_client/own.py": "_x = 1\n"
            "class C:\n    def f(self):\n        return self._y + _x\n",
            "client/queue_client/taker.py": "from queue_client.own import _x, C\n"
            "import queue_client.own as o\nfrom queue_client import own, __version__\n"
            "import queue_client.own\n"
            "a = o._z\nb = own._w\nc = queue_client.own._v\nd = C()._y\n",
            # A private module: its package's modules may use it, others may not.
            "server/queue_server/__init__.py": "",
            "server/queue_server/pkg/__init__.py": "",
            "server/queue_server/pkg/_helpers.py": "def public(): ...\n",
            "server/queue_server/pkg/user.py": "from queue_server.pkg._helpers import public\n",
            "server/queue_server/outsider.py": "from queue_server.pkg import _helpers\n",
        },
    )
    assert private_uses(tmp_path) == [
        ("queue_client.taker", "queue_client.own._v", 7),
        ("queue_client.taker", "queue_client.own._w", 6),
        ("queue_client.taker", "queue_client.own._x", 1),
        ("queue_client.taker", "queue_client.own._z", 5),
        ("queue_server.outsider", "queue_server.pkg._helpers", 1),
    ]
