"""Pipeline stages (model parallelism) on the in-process cluster: numerical fidelity against
single-process training, with micro-batches, one and two pipeline replicas, sync and async."""

from __future__ import annotations

import pytest

import dtrain
from tests.helpers.pipelines import stage_spec
from tests.helpers.reference import max_abs_diff, single_process

TOLERANCE = 1e-5


@pytest.mark.parametrize(("workers", "optimizer", "num_ps", "shared_memory"), [
    (2, "{name: sgd, lr: 0.1}", 1, True),
    (2, "{name: adam, lr: 0.01}", 2, False),
    (4, "{name: sgd, lr: 0.1}", 2, False),
    (4, "{name: adam, lr: 0.01}", 1, True),
])
def test_a_two_stage_pipeline_trains_as_one_process(inproc_client, tmp_path, workers, optimizer, num_ps,
                                                    shared_memory):
    spec = stage_spec(workers, optimizer, num_ps=num_ps, shared_memory=shared_memory)
    plan = dtrain.compile(spec)
    replicas = workers // 2
    assert plan.num_replicas == replicas and plan.stage_positions == 2
    assert [s.position for s in plan.stages] == [0, 1]
    assert {s.stage for s in plan.shards} == {0, 1}  # each stage has shards of its own

    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")

    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == 50
    assert s["samples"] == 50 * replicas * 16  # the step counted once per pipeline replica
    assert max_abs_diff(result.model, single_process(spec, replicas)) <= TOLERANCE
    stages = result.replica_stats[0]["extra"]["stages"]
    assert [st["extra"]["stage"]["position"] for st in stages] == [1]
    # Activations (16 x 24 floats a step) crossed the link: through shared memory on one machine
    # (only headers on the socket), else over the socket.
    link = stages[0]["extra"]["stage"]
    assert link["shared_memory"] is shared_memory
    moved = link["bytes_shared"] if shared_memory else link["bytes_received"]
    assert moved >= 50 * 16 * 24 * 4
    assert (link["bytes_received"] == 0) is shared_memory
    assert stages[0]["local_steps"] == 50


def test_the_pipeline_differs_from_training_with_one_micro_batch_of_another_model(inproc_client, tmp_path):
    """The comparison can fail: the reference with another seed is far from the run."""
    spec = stage_spec(2, "{name: sgd, lr: 0.1}", steps=20)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    wrong = single_process(spec, 2, steps=20)  # a doubled batch: other samples, other gradients
    assert max_abs_diff(result.model, wrong) > 1e-3


def test_async_pipeline_replicas_reach_accuracy(inproc_client, tmp_path):
    spec = stage_spec(4, "{name: adam, lr: 0.01}", mode="async", steps=300)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert result.summary["eval"]["accuracy"] >= 0.9


def test_stages_on_devices_of_one_task(inproc_client, tmp_path):
    """Layers pinned to a GPU of the replica's own task: a stage on that device in the same process
    (CUDA when present, else the CPU by soft placement), still single-process training."""
    import torch

    spec = dtrain.loads("""
name: device-stages
cluster: {jobs: {ps: 1, worker: 2}}
model:
  input_shape: [64]
  layers:
    - {type: linear, out: 24, device: /device:GPU:0}
    - {type: tanh, device: /device:GPU:0}
    - {type: linear, out: 10}
  loss: cross_entropy
data: {source: sklearn:digits, batch_size: 16}
optimizer: {name: sgd, lr: 0.1}
training: {mode: sync, steps: 20, seed: 5, microbatches: 2}
summary: {tensorboard: false}
""", base_dir=".")
    plan = dtrain.compile(spec)
    assert plan.stage_positions == 1 and plan.num_replicas == 2
    assert [s.device for s in plan.stages] == ["/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:CPU:0"]
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    gpu = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert result.replica_stats[0]["extra"]["stage"]["devices"] == [gpu, "cpu"]
    assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE


def test_a_resumed_pipeline_continues_exactly(inproc_client, tmp_path):
    spec = stage_spec(2, "{name: adam, lr: 0.01}", steps=20)
    spec = dtrain.loads(spec.model_dump_json(), base_dir=".", overrides=["checkpoint={every_steps: 10}"])
    first = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert first.summary["global_step"] == 20
    longer = dtrain.loads(spec.model_dump_json(), base_dir=".", overrides=["training.steps=30"])
    result = dtrain.run(longer, client=inproc_client, run_dir=tmp_path / "run", resume=True)
    assert result.summary["start_step"] == 20 and result.summary["global_step"] == 30
    assert max_abs_diff(result.model, single_process(longer, 1)) <= TOLERANCE


@pytest.mark.parametrize("slow", ["worker-0", "worker-1"])
def test_a_stage_whose_start_outlasts_the_link_timeout_still_trains(inproc_client, tmp_path, slow):
    """One stage builds its model for 1.5 times the links' call_timeout_s + barrier_timeout_s (a large
    stage, a cold first shard): stage 0's (worker-0) start delays stage 1's first FORWARD, stage 1's
    (worker-1) start delays stage 0's first BACKWARD. The neighbour waits that out
    (training.stage_start_timeout_s) instead of failing the run as a lost stage."""
    from tests.helpers.slowmodels import SlowStart

    SlowStart.SLEPT.clear()
    spec = dtrain.loads(f"""
name: slow-start
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  module: tests.helpers.slowmodels:SlowStart
  kwargs: {{delay_s: 3.0, slow_worker: {slow}}}
  input_shape: [64]
  loss: cross_entropy
placement:
  layer_devices: {{first: /job:worker/task:0, act: /job:worker/task:0, head: /job:worker/task:1}}
data: {{source: sklearn:digits, batch_size: 16}}
optimizer: {{name: sgd, lr: 0.1}}
training: {{mode: sync, steps: 10, seed: 5, microbatches: 2, call_timeout_s: 1, barrier_timeout_s: 1}}
summary: {{tensorboard: false}}
""", base_dir=".")
    assert dtrain.compile(spec).stage_positions == 2
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 10
    first = result.replica_stats[0]
    assert (first["worker"], first["extra"]["stages"][0]["worker"]) == ("worker-0", "worker-1")
    assert SlowStart.SLEPT == [slow]  # that stage's start was the slow one
