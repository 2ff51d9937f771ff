"""What pyproject.toml declares (review M8): the torch floor keeps torch.load(weights_only=True)
safe, since checkpoints and model.pt are loaded with it."""

from __future__ import annotations

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers.paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

SAFE_TORCH = Version("2.6")  # CVE-2025-32434: weights_only=True is bypassable in torch < 2.6


def _torch_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert len(found) == 1, project["dependencies"]
    return found[0]


def test_declared_torch_floor_is_safe():
    spec = _torch_requirement().specifier
    for unsafe in ("2.2.0", "2.5.1", "2.5.99", "1.13.1"):
        assert not spec.contains(unsafe, prereleases=True), f"torch {unsafe} is allowed by {spec}"
    assert spec.contains("2.6.0") and spec.contains("2.13.0")
    assert not spec.contains("3.0.0")


def test_installed_torch_is_at_least_the_floor():
    assert Version(torch.__version__.split("+")[0]) >= SAFE_TORCH
