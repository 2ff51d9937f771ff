"""The start-up profile's clock (``dtrain run --profile-startup``): a process's start time."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_start_falls_between_the_spawn_and_the_first_line():
    """The marks are measured from the process's start: it must lie between the parent's clock
    before the spawn and the child's first statement (psutil's create_time, from the boot time in
    whole seconds, could be up to a second off either way)."""
    code = "import time; t = time.time(); from dtrain.deploy.phases import process_start; print(process_start(), t)"
    for _ in range(3):
        before = time.time()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        start, first_line = map(float, out.stdout.split())
        assert before - 0.02 <= start <= first_line + 0.02, (before, start, first_line)
