"""The embedded cluster's worker processes fork from a warm server (dtrain/deploy/forkserver.py):
torch and dtrain's worker modules are imported before any task arrives, and each process still
gets the nannies' environment (dtrain's malloc thresholds) and its own thread settings. Real
worker processes (the tests marked ``processes``), and the server's effects on the rest of the
process: its socket, the processes a user's own code forks from it, `dtrain run`'s head start."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time

import dask
import psutil
import pytest

import dtrain
from dtrain.deploy.cluster import HOUSEKEEPING, MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD, connect
from tests.helpers.paths import ROOT

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
            "memory_monitor_ms": dask_worker.periodic_callbacks["memory_monitor"].callback_time,
            # (the server's module, as it saw this process when it forked it: no import here)
            "dtrain_worker": getattr(sys.modules.get("dtrain.deploy.quiet_signals"), "worker", None)}


@pytest.mark.processes
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
            # told from a process of the user's own code: it keeps SIGTERM ignored from its fork on
            assert info["dtrain_worker"] is True
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


@pytest.mark.processes
def test_a_ctrl_c_while_the_server_starts_does_not_kill_it():
    """A SIGINT to the run's process group while the forkserver's interpreter starts and imports
    torch (before quiet_signals, and multiprocessing's own handler, ignore it) is held, then
    discarded: the server lives and prints no traceback. It used to die with a KeyboardInterrupt
    traceback on the terminal (the chief's signal test, on a quick machine)."""
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


def _in_a_fresh_interpreter(tmp_path, code: str) -> list[str]:
    """Run ``code`` as a script (its functions can be forked targets) in a new Python; its output words."""
    script = tmp_path / "script.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


WARM = """
import multiprocessing, os, signal, stat, sys, time
from dtrain.deploy import forkserver
from dtrain.deploy.cluster import DASK_ENV
"""


def test_a_users_own_forkserver_process_keeps_the_default_signal_handling(tmp_path):
    """dtrain warms multiprocessing's process-wide forkserver (``dtrain.run`` in a user's program),
    and the server ignores SIGINT, SIGTERM and SIGHUP: every process the user's own code forked from
    it later (the forkserver context, Linux's default from Python 3.14; DataLoader workers) ignored
    them too, and ``Process.terminate()`` did nothing. Only dtrain's worker processes keep them
    ignored now."""
    out = _in_a_fresh_interpreter(tmp_path, WARM + """
def report(queue):
    queue.put(sum(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)))
    queue.put(getattr(sys.modules["dtrain.deploy.quiet_signals"], "worker", None))
    time.sleep(60)

if __name__ == "__main__":
    assert forkserver._start([], {**DASK_ENV, forkserver.METHOD_KEY: "forkserver"})
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    p = ctx.Process(target=report, args=(queue,))
    p.start()
    print(queue.get(timeout=60), queue.get(timeout=5))
    p.terminate()
    p.join(5)
    print("ended" if not p.is_alive() else "alive")
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    forkserver.stop()
""")
    assert out == ["0", "False", "ended"]  # no signal ignored; not a worker; ended by terminate()


def test_the_forkserver_listens_on_a_private_file_never_an_abstract_socket(tmp_path):
    """On Python 3.10.0-3.10.8 multiprocessing's forkserver listens on a Linux abstract socket, which
    any local user can connect to and send pickles to (CVE-2022-42919): dtrain turns abstract
    sockets off before it starts the server, so its socket is a 0600 file in a 0700 directory."""
    out = _in_a_fresh_interpreter(tmp_path, WARM + """
assert forkserver._start([], {**DASK_ENV, forkserver.METHOD_KEY: "forkserver"})
from multiprocessing import forkserver as mp, util
address = mp._forkserver._forkserver_address
print(util.abstract_sockets_supported, address.startswith("\\0"),
      oct(stat.S_IMODE(os.stat(address).st_mode)), oct(stat.S_IMODE(os.stat(os.path.dirname(address)).st_mode)))
forkserver.stop()
""")
    assert out == ["False", "False", "0o600", "0o700"]


def test_dtrain_run_of_a_deeply_nested_file_is_a_spec_error(tmp_path, capsys):
    """The head start of `dtrain run` reads the file before validation: 5,000 nested brackets raised
    a RecursionError there, a traceback with exit 1, where `validate` and `plan` exit 2 with one line."""
    from dtrain.cli import main

    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["run", str(deep), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{deep}:"), err
    assert not (tmp_path / "run").exists()
