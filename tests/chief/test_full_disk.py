"""A full disk under a real `dtrain run`: the checkpoint's write (its parts, written by the ps
processes, on a 4 KiB tmpfs mounted over the run's checkpoints/) and model.pt's (the chief's
fsync fails with ENOSPC) each fail the run, exit 1, with one line that says the disk is full;
the summary says so too, and no temporary file or process is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.processes

SETTINGS = ["--quiet", "--set", "training.steps=60", "--set", "summary.tensorboard=false", "--set", "eval={}"]


def run(run_dir: Path, *extra: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom dtrain.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "run", "pipelines/digits_async.yaml", "--run-dir",
                           str(run_dir), *SETTINGS, *extra], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)


def assert_failed_with_one_line(out: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("dtrain: ")]
    assert len(errors) == 1 and errors[0].startswith("dtrain: run failed: "), out.stderr[-3000:]
    assert "No space left on device" in errors[0], errors
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left on device" in summary["error"], summary
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name], list(run_dir.rglob("*"))


def test_a_full_disk_for_the_checkpoint_fails_the_run_with_one_line(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(run_dir / "checkpoints")],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        out = run(run_dir, "--set", "checkpoint={every_steps: 20}")
        assert_failed_with_one_line(out, run_dir)
        # torch's writer loses the errno (a short write: "unexpected pos ..."): the full disk is named
        assert "unexpected pos" not in out.stderr and "checkpoint" in out.stderr.splitlines()[-1]
    finally:
        subprocess.run(["umount", str(run_dir / "checkpoints")], check=True)


def test_a_full_disk_for_model_pt_fails_the_run_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    # The disk fills up as model.pt is written: its fsync fails (the OS boundary; the process is real).
    prelude = """
import errno, os
real_fsync = os.fsync
def fsync(fd):
    if ".model.pt.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fsync(fd)
os.fsync = fsync
"""
    out = run(run_dir, prelude=prelude)
    assert_failed_with_one_line(out, run_dir)
    assert not (run_dir / "model.pt").exists()
