"""Validation finds the user's modules (model.module, custom hooks) without importing them (M10,
M13): `dtrain validate` reports a module that cannot be found, and never runs a line of user code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dtrain
from dtrain.spec.errors import SpecError
from dtrain.spec.imports import missing_module
from tests.helpers.paths import ROOT


@pytest.fixture
def trap_package(tmp_path, monkeypatch):
    """A package whose __init__ (and submodule) leave a marker file when executed."""
    pkg = tmp_path / "trap_pkg"
    (pkg / "inner").mkdir(parents=True)
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (pkg / "__init__.py").write_text(code)
    (pkg / "inner" / "__init__.py").write_text(code)
    (pkg / "inner" / "models.py").write_text(code + "class Net:\n    pass\n")
    (pkg / "hooks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    for name in [m for m in sys.modules if m == "trap_pkg" or m.startswith("trap_pkg.")]:
        del sys.modules[name]


def test_modules_are_found_without_executing_packages(trap_package):
    assert missing_module("trap_pkg.inner.models:Net") is None
    assert missing_module("trap_pkg.inner.models.Net") is None  # the dotted form import_object also takes
    assert missing_module("trap_pkg.hooks:Anything") is None  # the attribute is plan/run's business
    assert "cannot find module 'trap_pkg.inner.nope' of 'trap_pkg.inner.nope:Net' in package 'trap_pkg.inner'" \
        in missing_module("trap_pkg.inner.nope:Net")
    assert "'models' is a module, not a package" in missing_module("trap_pkg.inner.models.Net.x:y")
    assert "on the Python path" in missing_module("no_such_top_level_pkg.models:Net")
    assert not trap_package.exists()  # importlib.util.find_spec would have run trap_pkg/__init__.py
    assert "trap_pkg" not in sys.modules


def test_validate_reports_a_missing_module_and_runs_no_user_code(trap_package, tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text("model: {module: trap_pkg.inner.models:Net}\nhooks: [{type: 'trap_pkg.hooks:H'}]\n")
    assert dtrain.load(ok).model.module == "trap_pkg.inner.models:Net"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  module: trap_pkg.inner.modles:Net\nhooks:\n  - {type: logging}\n"
                   "  - {type: 'trap_pkg.hookz:H'}\n")
    with pytest.raises(SpecError) as info:
        dtrain.load(bad)
    assert [(p.line, p.path) for p in info.value.problems] == [(2, "model.module"), (5, "hooks[1].type")]
    assert not trap_package.exists()


def test_validate_never_executes_a_pipelines_callable(tmp_path):
    """reviews/poc_module_exec.yaml: `dtrain plan` ran `subprocess:getoutput` with the pipeline's
    kwargs; `dtrain validate` must say ok (the module exists) without running it."""
    marker = tmp_path / "plan_executed_this"
    poc = tmp_path / "poc.yaml"
    poc.write_text(f"""\
model:
  module: "subprocess:getoutput"
  kwargs: {{cmd: "touch {marker}"}}
data: {{source: synthetic}}
""")
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", "validate", str(poc)], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{poc}: ok"
    assert not marker.exists()
    assert not (Path(tmp_path) / "plan_executed_this").exists()
