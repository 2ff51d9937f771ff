"""The embedded cluster's worker processes fork from a warm server (dtrain/deploy/forkserver.py):
torch and dtrain's worker modules are imported before any task arrives, and each process still
gets the nannies' environment (dtrain's malloc thresholds) and its own thread settings. Real
worker processes."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import sys
import time

import dask
import psutil
import pytest

import dtrain
from dtrain.deploy.cluster import HOUSEKEEPING, MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD, connect

pytestmark = pytest.mark.processes

SPEC = """
name: forked
cluster: {jobs: {ps: 1, worker: 1}, dashboard: false}
model:
  input_shape: [64]
  layers: [{type: linear, out: 10}]
data: {source: sklearn:digits, batch_size: 32}
training: {mode: async, steps: 5, torch_threads: 2}
"""


def _inside(dask_worker) -> dict:  # (client.run passes the worker)
    import psutil

    parent = psutil.Process().parent()
    return {"preloaded": sorted(m for m in ("torch", "dtrain.worker.tasks", "dtrain.ps.shard", "sklearn.datasets",
                                            "sklearn.model_selection") if m in sys.modules),
            "parent": " ".join(parent.cmdline()) if parent else "",
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "housekeeping": {key: dask.config.get(key) for key in HOUSEKEEPING},
            # (the callback the worker process itself runs, in milliseconds)
            "memory_monitor_ms": dask_worker.periodic_callbacks["memory_monitor"].callback_time}


def test_worker_processes_fork_from_a_preloaded_server(tmp_path):
    spec = dtrain.loads(SPEC, base_dir=".")
    with connect(spec) as conn:
        seen = conn.client.run(_inside)
        assert len(seen) == 2
        for info in seen.values():  # before any task: a spawned worker has imported none of these
            # (the digits and the split need no scikit-learn: it is not preloaded for them)
            assert info["preloaded"] == ["dtrain.ps.shard", "dtrain.worker.tasks", "torch"]
            assert "forkserver" in info["parent"]
            assert info["omp"] == "2"  # the worker's own (training.torch_threads)
            # Dask's housekeeping at dtrain's pace, not Dask's 20 ms tick and 100 ms memory
            # monitor (docs/performance.md, "Dask's own housekeeping")
            assert info["housekeeping"] == HOUSEKEEPING
            assert info["memory_monitor_ms"] == 500
        # ... and the nannies (in this process) read each worker's memory every 500 ms, not 100
        nannies = conn.cluster.workers.values()
        assert [n.periodic_callbacks["memory_monitor"].callback_time for n in nannies] == [500, 500]
        # glibc reads its malloc settings at exec, and the workers are forked from the server: the
        # server's own environment at its start must hold the nannies' pre-spawn settings.
        pid = multiprocessing.forkserver._forkserver._forkserver_pid
        environ = psutil.Process(pid).environ()
        assert environ.get("MALLOC_TRIM_THRESHOLD_") == str(MALLOC_TRIM_THRESHOLD)
        assert environ.get("MALLOC_MMAP_THRESHOLD_") == str(MALLOC_MMAP_THRESHOLD)
        # A SIGTERM to the run's process group reaches the server too: it must outlive it, or the
        # processes forked from it would read as exited (their status comes through the server).
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert conn.client.run(os.getpid) and len(conn.workers()) == 2
    result = dtrain.run(spec, run_dir=tmp_path / "run")  # and a run on it trains
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 5


def test_a_ctrl_c_while_the_server_starts_does_not_kill_it():
    """A SIGINT to the run's process group while the forkserver's interpreter starts and imports
    torch (before quiet_signals, and multiprocessing's own handler, ignore it) is held, then
    discarded: the server lives and prints no traceback. It used to die with a KeyboardInterrupt
    traceback on the terminal (the chief's signal test, on a quick machine)."""
    import subprocess

    code = """
import os, signal, sys, time
from dtrain.deploy import forkserver
from dtrain.deploy.cluster import DASK_ENV
assert forkserver._start(["torch"], {**DASK_ENV, forkserver.METHOD_KEY: "forkserver"})
from multiprocessing import forkserver as mp
pid = mp._forkserver._forkserver_pid
for _ in range(5):  # during the interpreter's start and the preload's imports
    os.kill(pid, signal.SIGINT)
    time.sleep(0.05)
time.sleep(3)
print("alive" if mp._forkserver._forkserver_pid and os.waitpid(pid, os.WNOHANG) == (0, 0) else "dead")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "alive", out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr, out.stderr[-3000:]
