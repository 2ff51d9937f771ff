"""Recovery from transient errors while every process lives, as TensorFlow's recoverable
MonitoredTrainingSession (monitored_session_test rows MS1-MS3, MS6-MS7): Aborted and Unavailable,
raised by a hook or met as a sync barrier that timed out, restart the session from the newest
checkpoint (or re-initialise at step 0 without one) within training.max_recoveries; any other
error fails the run. Runs use the shared in-process cluster and a tiny digits model."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from distributed.comm.core import CommClosedError

import dtrain
from dtrain.chief.recovery import is_transient
from dtrain.dataplane.protocol import DataPlaneError, DataPlaneUnavailable
from dtrain.errors import RunError
from dtrain.ps.shard import BarrierTimeout
from tests.helpers.errors import seen
from tests.helpers.paths import ROOT
from tests.helpers.pipelines import pipeline_yaml


def base(**kw) -> str:
    return pipeline_yaml("transient", summary={"every_steps": 5, "tensorboard": False}, **kw)


BASE = base()


def raising(tmp_path, error: str, step: int, extra: str = "", more: str = "", steps: int = 60) -> dtrain.PipelineSpec:
    return dtrain.loads(BASE + more + f"""
training: {{mode: sync, steps: {steps}{extra}}}
hooks: [{{type: "tests.helpers.errors:RaiseAt", args: {{step: {step}, error: {error}, path: "{tmp_path}/seen.jsonl"}}}}]
""", base_dir=".")


def logged_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def first_drop(steps: list[int]) -> int:
    """The index of the first summary record at or below the one before it (a new session)."""
    return next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])


def test_which_errors_are_transient():
    # TF's preemption errors and their analogues here ...
    for exc in (dtrain.Aborted("x"), dtrain.Unavailable("x"), BarrierTimeout("x"), TimeoutError(),
                ConnectionRefusedError(), CommClosedError("x"), DataPlaneUnavailable("no answer from the ps in 60 s")):
        assert is_transient(exc), exc
    # ... and nothing else: the run fails (X14).
    for exc in (RuntimeError("x"), RunError("x"), ValueError("x"), OSError(errno.ENOSPC, "full"), None,
                dtrain.OutOfRange("x"), KeyError("x"), DataPlaneError("ValueError: bad request"),
                DataPlaneError("no answer from the ps, but not a DataPlaneUnavailable")):
        assert not is_transient(exc), exc


@pytest.mark.parametrize(("error", "cls"), [("aborted", "Aborted"), ("unavailable", "Unavailable")])
def test_a_transient_error_without_checkpoints_reinitialises_at_step_0(inproc_client, run_dir, tmp_path, error,
                                                                      cls):
    # MS1/MS2: no saver; a hook raises Aborted (Unavailable) -> a fresh session, gs back to 0, and on.
    summary = dtrain.run(raising(tmp_path, error, 20), client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and summary["global_step"] == 60
    assert summary["recoveries"] == 1
    rec = summary["recovery_log"][0]
    assert rec["lost"] == [] and rec["error"].startswith(f"{cls}: raised by RaiseAt") and rec["restored_step"] == 0
    _, raised = seen(tmp_path / "seen.jsonl")
    assert raised is not None and raised >= 20
    steps = logged_steps(run_dir)
    i = first_drop(steps)
    assert steps[i] == 5 and steps[i - 1] >= 20  # the re-initialised session counts again from step 0
    assert steps[i:] == list(range(5, 61, 5))
    assert summary["eval"]["accuracy"] > 0.5


def test_a_transient_error_restores_the_newest_checkpoint(inproc_client, run_dir, tmp_path):
    # MS3: with a saver, the new session restores the newest checkpoint (the shards hold at each
    # multiple of every_steps until its snapshot is taken, so the hook at 25..30 sees step 20's,
    # or step 30's when the shards reached 30 first: a checkpoint being written is committed before
    # the new session starts).
    s = raising(tmp_path, "aborted", 25, more="checkpoint: {every_steps: 10, keep: 10}\n")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and summary["global_step"] == 60 and summary["recoveries"] == 1
    rec = summary["recovery_log"][0]
    restored = rec["restored_step"]
    assert restored in (20, 30) and restored <= rec["step"] < restored + 10, rec
    steps = logged_steps(run_dir)
    tail = list(range(restored + 5, 61, 5))  # the new session's records: resumed after the checkpoint, not from 0
    assert steps[-len(tail):] == tail and steps[-len(tail) - 1] >= restored, steps


def test_without_recoveries_the_transient_error_reaches_the_caller(inproc_client, run_dir, tmp_path):
    # MS7 (SingularMonitoredSession): training.max_recoveries: 0 -> the Aborted fails the run (exit 1).
    with pytest.raises(RunError, match=r"Aborted: raised by RaiseAt .*recovery attempts used up "
                                       r"\(training.max_recoveries: 0\)"):
        dtrain.run(raising(tmp_path, "aborted", 20, ", max_recoveries: 0", steps=5000), client=inproc_client,
                   run_dir=run_dir)
    # (5,000 steps: a run that failed at the hook's step ends long before its last step, however late
    # a loaded machine lets the chief see step 20; with 60 the replicas could reach the end first)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "Aborted" in summary["error"] and summary["global_step"] < 5000


def test_any_other_error_from_a_hook_fails_the_run_at_once(inproc_client, run_dir, tmp_path):
    # X14 / MS6: a RuntimeError is not recoverable, whatever max_recoveries allows.
    with pytest.raises(RunError, match="RuntimeError: raised by RaiseAt"):
        dtrain.run(raising(tmp_path, "runtime", 20, steps=5000), client=inproc_client, run_dir=run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["recoveries"] == 0 and summary["global_step"] < 5000


def test_a_sync_barrier_timeout_while_every_process_lives_is_recovered(inproc_client, run_dir, tmp_path):
    # X14: the first replica at its 20th batch stalls 6 s (once); the other's barrier gives up after
    # 2 s (BarrierTimeout from the ps). Nothing was lost: the session restarts and completes.
    stall = {"module": "tests.helpers.errors:StallOnce", "kwargs": {"flag": f"{tmp_path}/stalled"}}
    s = dtrain.loads(base(model=stall)
        + "training: {mode: sync, steps: 60, barrier_timeout_s: 2, call_timeout_s: 30}\n", base_dir=".")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert (tmp_path / "stalled").exists()
    assert summary["status"] == "completed" and summary["global_step"] == 60
    assert summary["recoveries"] == 1, summary["recovery_log"]
    rec = summary["recovery_log"][0]
    assert rec["lost"] == [] and "BarrierTimeout: " in rec["error"] and rec["restored_step"] == 0


@pytest.mark.processes
def test_the_cli_exits_1_when_a_transient_error_has_no_recovery_left(tmp_path):
    # MS7 through `dtrain run` (its embedded cluster): the Aborted reaches the caller as exit 1.
    path = tmp_path / "aborted.yaml"
    path.write_text(base(jobs={"ps": 1, "worker": 1}) + f"""
training: {{steps: 400, max_recoveries: 0}}
hooks: [{{type: "tests.helpers.errors:RaiseAt", args: {{step: 10, error: aborted, path: "{tmp_path}/seen.jsonl"}}}}]
""")
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(path), "--run-dir", str(tmp_path / "run"),
                          "--quiet"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Aborted: raised by RaiseAt" in out.stderr and "training.max_recoveries: 0" in out.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
