"""Pipeline stages in real worker processes (the embedded cluster of `dtrain run`): the stages
run in their own tasks' processes, the golden model-parallel pipeline reaches its accuracy, and
a killed stage worker restarts its pipeline replica."""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers.runs import finish, kill_pid, start_run, task_pid, wait_for_step

pytestmark = pytest.mark.processes


def test_stages_run_in_the_processes_of_their_tasks(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    pipeline = tmp_path / "stages.yaml"
    pipeline.write_text(f"""
name: stage-processes
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  module: tests.helpers.models:StageRecorder
  kwargs: {{record_dir: {str(record)!r}}}
  input_shape: [64]
  loss: cross_entropy
placement:
  layer_devices: {{encoder: /job:worker/task:0, act: /job:worker/task:0, head: /job:worker/task:1}}
data: {{source: sklearn:digits, batch_size: 16}}
optimizer: {{name: sgd, lr: 0.1}}
training: {{mode: sync, steps: 30, microbatches: 2}}
""")
    run_dir = tmp_path / "run"
    code, out, err = finish(start_run(str(pipeline), run_dir))
    assert code == 0, err[-4000:]
    pid0, pid1 = task_pid(run_dir, "/job:worker/task:0"), task_pid(run_dir, "/job:worker/task:1")
    assert pid0 != pid1
    seen: dict[str, set[tuple[int, str]]] = {}
    for f in record.iterdir():
        child, pid, device = f.name.rsplit("-", 2)
        seen.setdefault(child, set()).add((int(pid), device))
    # Training forwards ran only in the stage's own task process, on the CPU there.
    assert seen["encoder"] == {(pid0, "cpu")} and seen["act"] == {(pid0, "cpu")}
    assert seen["head"] == {(pid1, "cpu")}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 30


def test_the_model_parallel_pipeline_reaches_accuracy_and_survives_a_lost_stage(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run("pipelines/digits_model_parallel.yaml", run_dir, "--set", "summary.every_steps=25",
                     "--set", "training.barrier_timeout_s=30", "--set", "training.call_timeout_s=90")
    wait_for_step(proc, run_dir, random.Random("stage").randint(150, 300))
    kill_pid(task_pid(run_dir, "/job:worker/task:1"))  # the second stage's process
    code, out, err = finish(proc)
    assert code == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 600
    assert summary["recoveries"] == 1
    assert summary["recovery_log"][0]["lost"] == ["/job:worker/task:1"]
    assert summary["eval"]["accuracy"] >= 0.95
