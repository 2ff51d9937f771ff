"""`dtrain run` as a child process, for the fault tests that kill its tasks by pid: start it,
wait for a step in its metrics.jsonl, find a task's pid, kill it, collect the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until


def start_run(pipeline: str, run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", pipeline, "--run-dir", str(run_dir),
                             "--quiet", *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def logged_step(run_dir: Path) -> int | None:
    """The highest step in ``run_dir``'s metrics.jsonl (None before its first line)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]
    return max(steps) if steps else None


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> int:
    """Poll metrics.jsonl until the global step reaches ``step``; return the step seen."""

    def running() -> None:
        assert proc.poll() is None, proc.communicate()[1][-3000:]

    def reached() -> bool:
        running()
        seen = logged_step(run_dir)
        return seen is not None and seen >= step

    wait_until(reached, timeout, f"step {step}", check=running)
    return logged_step(run_dir)  # type: ignore[return-value]


def task_pids(run_dir: Path) -> dict[str, int]:
    """Every task's pid from ``run_dir``'s cluster.json ({} before it is written)."""
    try:
        return {k: int(v["pid"]) for k, v in json.loads((run_dir / "cluster.json").read_text())["tasks"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def task_pid(run_dir: Path, task: str) -> int:
    info = json.loads((run_dir / "cluster.json").read_text())
    return int(info["tasks"][task]["pid"])


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def kill_pid(pid: int) -> None:
    assert psutil.pid_exists(pid)
    os.kill(pid, signal.SIGKILL)
