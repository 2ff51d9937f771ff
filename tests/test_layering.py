"""The planes stay apart (STYLE.md items 1, 2 and 7; docs/architecture.md):

- the spec, the model and data math, the plan, the ps and the data plane never import Dask;
- the spec never imports the planes that run it; the compiler is pure (no Dask, no runtime);
- the ps side and the worker side never import the chief;
- nothing below the chief imports the chief or deployment (Spec -> Plan -> run, one direction);
- the replication rules are a pure state machine;
- every module stays under a soft ceiling of 800 lines, save the few ``LONG_MODULES`` allows
  (docs/development.md lists them, with the reason: a module's size follows its role).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.imports import imported, parse, tops
from tests.helpers.paths import PKG

DASK = {"dask", "distributed"}
MAX_LINES = 800
# Modules allowed past MAX_LINES, each with its own ceiling and the reason it is one module
# (kept in step with docs/development.md, "Module size").
LONG_MODULES: dict[str, tuple[int, str]] = {}


def modules(package: str) -> list[Path]:
    return sorted((PKG / package).glob("*.py"))


def planes(names: set[str]) -> set[str]:
    """The dtrain subpackages among ``names`` ('dtrain.chief.session' -> 'chief')."""
    return {n.split(".")[1] for n in names if n.startswith("dtrain.") and n.count(".") >= 1}


NO_DASK = ["spec", "model", "data", "plan", "ps", "dataplane", "serving"]
ALLOWED = {  # plane -> the dtrain planes it may import
    "spec": {"spec", "model", "data"},  # shape inference and data checks at validation
    "model": {"model", "data"},  # a recommendation model unpacks the records the data plane packs
    "data": {"data"},
    "plan": {"plan", "spec", "model", "data"},  # the input plan assigns a sharded dataset's shards
    "ps": {"ps", "dataplane", "model", "observe"},  # observe.meters: the shard's load counters  # the ps initialises its table rows as the model does
    "dataplane": {"dataplane"},
    "worker": {"worker", "ps", "dataplane", "plan", "spec", "model", "data", "observe"},
    "serving": {"serving", "spec", "model", "worker"},  # an export's model: the replica's table lookups
    "observe": {"observe"},  # telemetry: pure meters and diagnosis, the scheduler's plugin and pages
    "graph": {"graph", "spec", "plan", "chief", "deploy"},
    "deploy": {"deploy", "plan", "spec", "observe"},  # registers the telemetry plugin on connecting
    "chief": {"chief", "worker", "ps", "dataplane", "plan", "spec", "model", "data", "deploy", "graph",
              "observe"},
}
# Top-level leaf modules every plane may import (they import nothing of dtrain): the runtime's errors.
LEAVES = {"errors"}
ALL = [(plane, path) for plane in ALLOWED for path in modules(plane)]


def test_every_plane_is_listed():
    found = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(ALLOWED)


@pytest.mark.parametrize(("plane", "path"), [(pl, p) for pl, p in ALL if pl in NO_DASK],
                         ids=lambda v: v if isinstance(v, str) else f"{v.parent.name}/{v.name}")
def test_math_and_spec_never_import_dask(plane, path):
    assert not tops(imported(path)) & DASK, f"{path.relative_to(PKG)} imports Dask"


@pytest.mark.parametrize(("plane", "path"), ALL,
                         ids=lambda v: v if isinstance(v, str) else f"{v.parent.name}/{v.name}")
def test_planes_import_only_what_they_may(plane, path):
    extra = planes(imported(path)) - ALLOWED[plane] - LEAVES
    assert not extra, f"{path.relative_to(PKG)} ({plane}) imports the {sorted(extra)} plane(s)"


def test_the_leaves_import_nothing_of_dtrain():
    for leaf in LEAVES:
        assert not {n for n in imported(PKG / f"{leaf}.py") if n.split(".")[0] == "dtrain"}, leaf


def test_worker_and_ps_never_import_the_chief():
    for plane in ("worker", "ps", "dataplane"):
        for path in modules(plane):
            assert "chief" not in planes(imported(path)), path


def test_torch_math_modules_never_import_dask():
    """The replica's step and the ps's apply are torch only (orchestration lives in tasks/chief)."""
    for rel in ("worker/replica.py", "worker/buckets.py", "graph/ops.py"):
        assert not tops(imported(PKG / rel)) & DASK, rel


def test_meters_and_diagnosis_are_pure():
    """The counters the ps and the replicas update, and the rules that read them: no Dask, no torch."""
    for rel in ("observe/meters.py", "observe/diagnosis.py"):
        names = imported(PKG / rel)
        assert tops(names) - {"dtrain"} <= {"__future__", "dataclasses", "math", "statistics", "time", "typing"}, rel
        assert {n for n in names if n.startswith("dtrain")} <= {"dtrain.observe.meters"}, rel


def test_replication_rules_are_pure():
    assert tops(imported(PKG / "ps" / "replication.py")) <= {"__future__", "dataclasses"}


def test_the_cli_and_the_spec_import_no_dask_at_module_level():
    """`dtrain validate` must not pay for Dask: the CLI and the spec import it only in functions."""
    for path in [PKG / "cli.py", PKG / "__init__.py", *modules("spec")]:
        tree = parse(path.read_text(), str(path))
        top = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                top |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top.add(node.module.split(".")[0])
        assert not top & DASK, path


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_modules_stay_under_the_soft_ceiling(path):
    rel = str(path.relative_to(PKG))
    limit, _why = LONG_MODULES.get(rel, (MAX_LINES, ""))
    assert len(path.read_text().splitlines()) <= limit, (
        f"{rel} is over {limit} lines: split it by role, or add it to LONG_MODULES (and docs/development.md) "
        "with the reason it is one module")


def test_the_allow_list_is_documented():
    text = (PKG.parent / "docs" / "development.md").read_text()
    for rel in LONG_MODULES:
        assert f"`dtrain/{rel}`" in text, f"dtrain/{rel} is in LONG_MODULES but not in docs/development.md"
