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


def crash_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL every process of group ``pgid`` (a `dtrain run` started in a session of its own), as
    the crash of their machine would, except multiprocessing's resource trackers: frozen with the
    rest (SIGSTOP, so that none reacts to another's death), they are let go once the others are
    dead, see their pipe close and unlink the named semaphores (``/dev/shm/sem.mp-*``) that the
    killed processes registered. A crashed machine starts again with an empty /dev/shm; the test
    machine's stays, and a plain ``killpg`` left 48 semaphores in it per run."""
    os.killpg(pgid, signal.SIGSTOP)
    members = group_members(pgid)
    trackers = [p for p in members if "multiprocessing.resource_tracker" in " ".join(p.info["cmdline"] or ())]
    for p in members:
        if p not in trackers:
            _signal(p.pid, signal.SIGKILL)
    for p in trackers:
        _signal(p.pid, signal.SIGCONT)
    psutil.wait_procs(trackers, timeout=timeout)
    _signal(-pgid, signal.SIGKILL)  # (anything the group still holds: a child forked as it was frozen, a stuck tracker)


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` now (with their command lines); one that ends meanwhile is left out."""
    return [p for p in psutil.process_iter(["cmdline"]) if _group(p.pid) == pgid]


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _signal(pid: int, sig: int) -> None:
    """``os.kill``; a process already gone (or a group already empty) is fine."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
