"""Fault tests with real worker processes, killed with SIGKILL by pid at a seeded random step:
in-graph recovery from a lost worker, and resume after the `dtrain run` process itself is killed.
(A lost ps or worker in async and sync runs: test_chaos.py, five kills each.)"""

from __future__ import annotations

import json
import random
import signal

import psutil
import pytest
import torch

from dtrain.chief import checkpoint as dtrain_checkpoint
from tests.helpers.paths import ROOT
from tests.helpers.runs import finish, kill_pid, start_run, task_pid, wait_for_step

pytestmark = pytest.mark.processes


def test_killed_run_resumes_to_the_same_parameters(tmp_path):
    """Sync, fixed seed, 2 replicas, no backups: kill `dtrain run`, --resume, same parameters as a
    run that never stopped (within 1e-6)."""
    settings = ["--set", "training.steps=300", "--set", "checkpoint={every_steps: 50, keep: 2}",
                "--set", "summary.every_steps=10", "--set", "eval={}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    proc = start_run("pipelines/digits_sync.yaml", run_dir, *settings)
    wait_for_step(proc, run_dir, random.Random("resume").randint(120, 200))
    kill_pid(proc.pid)  # the client process: scheduler and nannies die with it
    proc.communicate()
    ckpts = dtrain_checkpoint.list_checkpoints(run_dir)
    assert ckpts and not (run_dir / "model.pt").exists()
    # Without --resume a run directory holding checkpoints is refused: exit 2, nothing started.
    code2, out2, err2 = finish(start_run("pipelines/digits_sync.yaml", run_dir, *settings), timeout=60)
    assert code2 == 2 and "--resume" in err2
    code, out, err = finish(start_run("pipelines/digits_sync.yaml", ref_dir, *settings))
    assert code == 0, err[-3000:]
    # The kill may land between a checkpoint and its manifest: resume uses the newest valid one.
    expected = dtrain_checkpoint.latest(run_dir).step
    code3, out3, err3 = finish(start_run("pipelines/digits_sync.yaml", run_dir, *settings, "--resume"))
    assert code3 == 0, err3[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["start_step"] == expected and resumed["global_step"] == 300
    a = torch.load(ref_dir / "model.pt", weights_only=True)
    b = torch.load(run_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


# A SIGINT to the chief alone (SIGTERM to it alone: test_signals.py's second-SIGTERM test; to the
# whole process group: its seeded moments).
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130)])
def test_signal_writes_a_checkpoint_and_exits(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = start_run("pipelines/digits_async.yaml", run_dir, "--set", "checkpoint={every_steps: 100000}",
                     "--set", "summary.every_steps=20")
    seen = wait_for_step(proc, run_dir, 60)
    children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(sig)
    rc, out, err = finish(proc, timeout=120)
    assert rc == code, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    ckpts = dtrain_checkpoint.list_checkpoints(run_dir)
    assert ckpts and int(ckpts[-1].name[5:13]) >= seen
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in children if psutil.pid_exists(p)], timeout=20)
    assert not alive, "the embedded cluster's processes outlived the run"


def test_in_graph_restarts_its_step_driver_from_the_checkpoint_after_a_lost_worker(tmp_path):
    """In-graph replication: a lost worker task fails the step in flight; the chief restores
    every shard from the newest checkpoint and restarts the driver (nothing half-applied)."""
    run_dir = tmp_path / "run"
    every = 50
    proc = start_run("pipelines/digits_in_graph.yaml", run_dir, "--set", "training.steps=400",
                     "--set", f"checkpoint={{every_steps: {every}, keep: 2}}", "--set", "summary.every_steps=10",
                     "--set", "summary.tensorboard=false")
    seen = wait_for_step(proc, run_dir, random.Random("in-graph").randint(80, 160))
    kill_pid(task_pid(run_dir, "/job:worker/task:1"))
    code, out, err = finish(proc)
    assert code == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 400 and summary["recoveries"] == 1
    rec = summary["recovery_log"][0]
    assert rec["lost"] == ["/job:worker/task:1"], rec
    assert rec["restored_step"] % every == 0 and rec["restored_step"] >= (seen - 1) // every * every, (rec, seen)
    assert summary["eval"]["accuracy"] >= 0.9


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_killed_ps_gets_its_table_rows_back_from_the_checkpoint(tmp_path):
    """pipelines/ctr_sparse.yaml (a 100,000-row table over 2 ps tasks, sync): SIGKILL ps-1 mid-run;
    its rows and their Adagrad accumulators come back from the checkpoint, and the run ends where
    an uninterrupted single-process torch run with sparse embeddings ends (a restart from the
    initial rows, or rows restored onto the wrong part, would be far off)."""
    import dtrain
    from tests.helpers.reference import single_process

    run_dir, steps, every = tmp_path / "run", 200, 40
    # Adagrad's eps 1e-3 (the pipeline's is torch's 1e-10): a row's first update is g / (|g| + eps),
    # which turns a gradient element that is ~0 up to rounding into an update of either sign, so
    # batch-order rounding would move a few rows by ~1e-3 between any two exact implementations.
    settings = [f"training.steps={steps}", f"checkpoint={{every_steps: {every}, keep: 2}}", "summary.every_steps=10",
                "eval={}", "training.barrier_timeout_s=30", "training.call_timeout_s=20",
                "optimizer={name: adagrad, lr: 0.1, eps: 0.001}"]
    proc = start_run("pipelines/ctr_sparse.yaml", run_dir, *[a for s in settings for a in ("--set", s)])
    wait_for_step(proc, run_dir, random.Random("ps-table").randint(90, 150))
    kill_pid(task_pid(run_dir, "/job:ps/task:1"))
    code, out, err = finish(proc)
    assert code == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == steps and summary["recoveries"] >= 1
    rec = summary["recovery_log"][0]
    assert "/job:ps/task:1" in rec["lost"] and rec["restored_step"] >= every and rec["restored_step"] % every == 0
    spec = dtrain.load(ROOT / "pipelines" / "ctr_sparse.yaml", overrides=settings)
    reference = single_process(spec, num_replicas=2).state_dict()
    final = torch.load(run_dir / "model.pt", weights_only=True)
    assert final["0.weight"].shape == (100_000, 16)
    assert max(float((final[k] - reference[k]).abs().max()) for k in reference) <= 1e-5
