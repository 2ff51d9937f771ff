"""No import circle in dtrain/ (docs/architecture.md, "Import circles").

Every dtrain-internal import counts, wherever it is written: at module level, inside a function
(a lazy import still closes a circle at run time), and under ``if TYPE_CHECKING:`` (a circle
that only the type checker sees is still two modules that know each other). A circle is a
strongly connected component of that graph. A circle not cut yet would be listed in
``KNOWN_CIRCLES`` with the reason (none is now); an entry that no longer matches a circle fails
too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.imports import parse
from tests.helpers.paths import PKG

# Circles not cut yet: the modules of each, exactly, and why it stands. None is left; the entry
# stays for a circle that cannot be cut in the change that makes it (a new one is cut, not listed).
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package at ``root`` it imports (every import statement, at
    any depth; ``from pkg import name`` counts as the module ``pkg.name`` when there is one)."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == root.name}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != root.name:
                    continue
                deps |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in paths else resolve(mod) for a in node.names}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & component))}" for m in sorted(component))


def test_dtrain_has_no_import_circle_but_the_known_ones():
    graph = import_graph(PKG)
    found = circles(graph)
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circle(s) in dtrain/ (function-level and TYPE_CHECKING imports count):\n" + \
        "\n".join(describe(c, graph) for c in new)
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"no longer a circle (or a different one now): remove or update KNOWN_CIRCLES' {gone}"


def test_lazy_and_type_checking_imports_close_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg.sub import a\n    return a\n")
    (pkg / "sub" / "c.py").write_text("from . import a\nimport os\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.a"}
    assert circles(graph) == [frozenset({"pkg.sub.a", "pkg.sub.b"})]
