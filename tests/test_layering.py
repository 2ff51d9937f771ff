"""The math never imports Dask; the orchestration stays out of the math (STYLE.md item 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import PKG

MATH = ["model/layers.py", "data/sources.py", "plan/layout.py", "ps/shard.py", "worker/replica.py",
        "ps/replication.py", "spec/device.py", "plan/placement.py", "plan/compiler.py", "spec/pipeline.py",
        "spec/loading.py", "chief/checkpoint.py", "chief/metrics.py"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            names.add("." + node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", MATH)
def test_math_modules_do_not_import_dask(name):
    mods = imported_modules(PKG / name)
    assert not mods & {"dask", "distributed"}, f"{name} imports {mods & {'dask', 'distributed'}}"
    # nor anything that does
    assert not mods & {".session", ".cluster", ".tasks", ".ingraph", ".graph"}


def test_replication_rules_are_pure():
    assert imported_modules(PKG / "ps/replication.py") <= {"__future__", "dataclasses"}
