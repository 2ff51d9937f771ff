"""The `dtrain` command as a child process, for the tests of the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT


def dtrain_cli(*args: str, timeout: float = 240, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m dtrain.cli *args`` from ``cwd`` with this checkout on the path; its output captured."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "dtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
