"""What a module of the package imports, read from its source (tests/test_layering.py's checks)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import PKG


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, again when CPython 3.11 reports "AST constructor recursion depth mismatch":
    its parser's recursion counter is shared by every thread, so a parse while another thread
    (a Dask client's, left by an earlier test in the same process) compiles code can trip that
    check; the source is fine and a second parse reads it."""
    for attempt in range(3):
        try:
            return ast.parse(source, filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names ('dtrain.ps.shard', 'distributed', ...);
    relative imports resolved against the module's package (function-level imports included)."""
    tree = parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names |= {mod} | ({f"{mod}.{a.name}" for a in node.names} if not node.module else set())
            elif node.module:
                names.add(node.module)
    return names


def tops(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}
