"""The package's import graph: no cycles, no private names across packages (docs/design.md).

`lint-imports` checks the layer contracts of ``pyproject.toml``; this test reads every
``import`` statement of ``r3arrow/`` itself — module level, inside functions, and
``importlib.import_module("r3arrow....")`` calls with a literal name — so an import hidden in
a function cannot close a cycle unseen. Imports under ``if TYPE_CHECKING:`` are left out
(they never run).

The private-name rule: a module may import the private modules and names (leading ``_``) of
its own package and of the packages above it (``r3arrow._checks`` from ``r3arrow.io``), never
those of a sibling or cousin package (``r3arrow.io._layout`` from ``r3arrow.cli``): what two
packages share gets a public home.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "r3arrow"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (the longest prefix that is a module of the package)
    path: str  # dotted path as written, with the imported name (``r3arrow.io._layout.x``)


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported(module: str, is_pkg: bool, tree: ast.AST) -> Iterator[str]:
    """Dotted paths imported by ``module`` (``a.b`` for ``import a.b``, ``a.b.c`` for
    ``from a.b import c``), relative imports resolved."""
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            yield from (f"{base}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] == "import_module"
            and node.args
        ):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value
            elif isinstance(arg, ast.JoinedStr):  # f"r3arrow.{name}": the literal prefix
                head = arg.values[0]
                if isinstance(head, ast.Constant) and isinstance(head.value, str):
                    yield head.value.rstrip(".")


def import_edges(root: Path = ROOT) -> tuple[dict[str, Path], list[Edge]]:
    """Every import of a package module by a package module."""
    mods = _modules(root)
    edges = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for dotted in _imported(module, path.name == "__init__.py", tree):
            if not dotted.startswith(f"{root.name}.") and dotted != root.name:
                continue
            target = dotted
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module:
                edges.append(Edge(module, target, dotted))
    return mods, edges


def cycles(mods: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _package_of(module: str, mods: dict[str, Path]) -> str:
    return module if mods[module].name == "__init__.py" else module.rpartition(".")[0]


def private_crossings(mods: dict[str, Path], edges: list[Edge]) -> list[str]:
    """Imports of a private module or name owned by a package that does not contain the
    importer."""
    bad = []
    for e in edges:
        parts = e.path.split(".")
        first = next(
            (i for i, s in enumerate(parts) if s.startswith("_") and not s.startswith("__")),
            None,
        )
        if first is None:
            continue
        owner = ".".join(parts[:first])
        home = _package_of(e.source, mods)
        if home != owner and not home.startswith(owner + "."):
            bad.append(f"{e.source} imports {e.path}")
    return sorted(set(bad))


def test_no_import_cycles() -> None:
    mods, edges = import_edges()
    assert cycles(mods, edges) == []


def _area(module: str) -> str:
    """The first-level package or module under the root (``r3arrow.io`` for ``r3arrow.io._x``)."""
    return ".".join(module.split(".")[:2])


def test_no_cycles_between_areas() -> None:
    """Collapsed to first-level packages (io, capture, table, ...), the graph is acyclic too."""
    mods, edges = import_edges()
    areas = {_area(m): ROOT for m in mods}
    lifted = [Edge(_area(e.source), _area(e.target), e.path) for e in edges]
    assert cycles(areas, [e for e in lifted if e.source != e.target]) == []


def test_no_private_names_imported_across_packages() -> None:
    mods, edges = import_edges()
    assert private_crossings(mods, edges) == []


# ------------------------------------------------- the checker itself, on small literal trees
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_checker_sees_function_level_and_import_module_cycles(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from pkg import b\n",
            "b.py": "import importlib\nimportlib.import_module('pkg.c')\n",
            "c.py": "from typing import TYPE_CHECKING\nimport pkg.a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n",
            "e.py": "import pkg.d\n",
        },
    )
    mods, edges = import_edges(root)
    assert cycles(mods, edges) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize(
    ("source", "text", "crosses"),
    [
        ("x/m.py", "from pkg.y._impl import f\n", True),  # a sibling's private module
        ("x/m.py", "from pkg.y import _f\n", True),  # a sibling's private name
        ("x/m.py", "from pkg._shared import f\n", False),  # an ancestor's private module
        ("x/m.py", "from pkg.x._impl import f\n", False),  # its own package's
        ("x/m.py", "from ._impl import f\n", False),
        ("x/sub/m.py", "from pkg.x._impl import f\n", False),  # a parent package's
        ("y/_impl.py", "from pkg.x._impl import f\n", True),
    ],
)
def test_checker_private_rule(tmp_path: Path, source: str, text: str, crosses: bool) -> None:
    files = {
        "__init__.py": "",
        "_shared.py": "f = 1\n",
        "x/__init__.py": "",
        "x/_impl.py": "f = 1\n",
        "x/sub/__init__.py": "",
        "y/__init__.py": "_f = 1\n",
        "y/_impl.py": "f = 1\n",
    }
    files[source] = text
    mods, edges = import_edges(_tree(tmp_path, files))
    assert bool(private_crossings(mods, edges)) is crosses
