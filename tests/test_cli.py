"""The `dtrain` command as users run it: real processes, an embedded cluster of real Dask
worker processes, exit codes as docs/cli.md states them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import dtrain_cli as dtrain
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a `dtrain` process (Python, torch) per command


def test_validate_ok_for_every_pipeline():
    files = sorted(str(p) for p in (ROOT / "pipelines").glob("*.yaml"))
    out = dtrain("validate", *files)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": ok") == len(files)


def test_plan_json_contract():
    out = dtrain("plan", "pipelines/digits_async.yaml", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert [v["name"] for v in plan["variables"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert plan["variables"][0]["shape"] == [128, 64]
    assert plan["ps_bytes"] == {"/job:ps/task:0": (128 * 64 + 10 * 128) * 4, "/job:ps/task:1": (128 + 10) * 4}
    assert [r["task"] for r in plan["replicas"]] == ["/job:worker/task:0", "/job:worker/task:1"]


def test_plan_text_and_schema():
    out = dtrain("plan", "pipelines/digits_async.yaml")
    assert out.returncode == 0 and "/job:ps/task:1" in out.stdout and "replica 1" in out.stdout
    schema = json.loads(dtrain("schema").stdout)
    assert "training" in schema["properties"] and schema["properties"]["training"]


def test_usage_error_exits_2():
    out = dtrain("run")
    assert out.returncode == 2 and "usage" in out.stderr


def _children_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.processes
def test_run_digits_async_end_to_end(tmp_path):
    """`dtrain run pipelines/digits_async.yaml`: 2 ps + 2 worker processes, accuracy >= 0.95;
    `--profile-startup` prints every phase, in order, timed from the process's start."""
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml",
                             "--run-dir", str(run_dir), "--quiet", "--profile-startup"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= {p.pid for p in _children_of(proc.pid)}
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.time() - t0
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["eval"]["accuracy"] >= 0.95
    assert "completed at step" in stdout
    table = stderr[stderr.index("phase "):].splitlines()[1:]
    rows = [re.fullmatch(r"(.+?)\s+(\d+\.\d\d)\s+(\d+\.\d\d)", line).groups() for line in table]
    assert [r[0].split(" (")[0].split(",")[0] for r in rows] == [
        "python start", "validation", "pre-flight: the user's code", "embedded cluster: scheduler", "connected: a worker for "
        "every task", "ps actors created", "first step", "training", "final evaluation", "summary", "cluster shutdown"]
    ends = [float(r[2]) for r in rows]
    assert ends == sorted(ends) and 0 < ends[-1] <= wall + 0.5  # from the process's own start, not before
    # 2 replicas x 2 shards, each replica in its own worker process: shared memory between processes
    dp = summary["data_plane"]
    assert dp["connections"] == 4
    assert dp["shared_memory_connections"] == (4 if Path("/dev/shm").is_dir() else 0)
    for name in ("metrics.jsonl", "model.pt", "summary.json"):
        assert (run_dir / name).is_file()
    assert len(seen) >= 4  # the worker processes really existed ...
    # ... and none outlived the run: a child still finishing its own exit (multiprocessing's resource
    # tracker reads EOF when the chief exits) gets a few seconds; one that stays is left behind.
    procs = []
    for pid in seen:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(procs, timeout=5)
    still = [p for p in still if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not still, [(p.pid, p.cmdline()[:6]) for p in still]


@pytest.mark.processes
def test_run_replica_error_exits_1(tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text("""
name: broken
cluster: {jobs: {ps: 1, worker: 1}}
model: {module: "tests.helpers.models:BrokenMLP"}
data: {source: sklearn:digits}
training: {steps: 20}
""")
    out = dtrain("run", str(spec), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "replica 0" in out.stderr and "mat1 and mat2 shapes cannot be multiplied" in out.stderr
    assert "Traceback" not in out.stderr.split("run failed")[-1]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_invalid_pipeline_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntraining:\n  mode: asynch\n")
    out = dtrain("run", str(bad), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    assert f"{bad}:3: training.mode:" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_unreachable_scheduler_exits_1_and_writes_nothing(tmp_path):
    """A cluster that was never reached means a run that never started: exit 1 with the address,
    and no run directory (a summary.json there would claim a run)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = dtrain("run", "pipelines/digits_async.yaml", "--scheduler", f"tcp://127.0.0.1:{port}",
                     "--run-dir", str(tmp_path / "run"), "--quiet", "--set", "cluster.wait_s=2")
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"cannot reach the scheduler at tcp://127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
