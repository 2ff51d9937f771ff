"""Where things are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PIPELINES = ROOT / "pipelines"
SPECS = ROOT / "tests" / "specs"
PKG = ROOT / "dtrain"
