"""What a module of the package imports, read from its source (tests/test_layering.py's checks)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import PKG


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names ('dtrain.ps.shard', 'distributed', ...);
    relative imports resolved against the module's package (function-level imports included)."""
    tree = ast.parse(path.read_text())
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
