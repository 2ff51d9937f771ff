"""Synchronous replication on the in-process cluster: numerical fidelity against single-process
training, backup replicas, and the bounded-staleness and sync golden pipelines."""

from __future__ import annotations

import pytest

import dtrain
from dtrain.chief.session import Session
from dtrain.deploy.cluster import connect
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import OPTIMIZERS, mlp, pipeline_yaml
from tests.helpers.reference import max_abs_diff, single_process

TOLERANCE = 1e-5


def sync_spec(num_ps: int, replicas: int, optimizer: str, steps: int = 100, placement: str = "round_robin",
              replication: str = "between_graph") -> dtrain.PipelineSpec:
    return dtrain.loads(pipeline_yaml(
        "sync-fidelity", jobs={"ps": num_ps, "worker": replicas}, model=mlp(loss="cross_entropy"),
        placement={"variables": placement, "min_slice_bytes": 64}, data={"source": "sklearn:digits", "batch_size": 8},
        optimizer=OPTIMIZERS[optimizer], training={"replication": replication, "mode": "sync", "steps": steps, "seed": 3},
        summary={"every_steps": 50, "tensorboard": False}), base_dir=".")


@pytest.mark.parametrize(("num_ps", "replicas", "optimizer", "placement"), [
    (1, 2, "sgd", "round_robin"),
    (2, 2, "sgd", "partitioned"),  # parameters split across both shards
    (1, 3, "sgd", "round_robin"),
    (2, 3, "sgd", "round_robin"),
    (2, 2, "momentum", "round_robin"),
    (1, 3, "momentum", "round_robin"),
    (1, 2, "adam", "round_robin"),
    (2, 3, "adam", "greedy"),
])
def test_sync_matches_single_process_training(inproc_client, tmp_path, num_ps, replicas, optimizer, placement):
    spec = sync_spec(num_ps, replicas, optimizer, placement=placement)
    plan = dtrain.compile(spec)
    assert len(plan.shards) == num_ps and plan.num_replicas == replicas
    if placement == "partitioned":
        assert any(v.start > 0 for v in plan.variables)  # a parameter really is split

    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")

    s = result.summary
    assert s["status"] == "completed"
    assert s["global_step"] == spec.training.steps
    assert s["dropped_stale"] == 0  # every replica is in every step's quorum
    assert s["samples"] == spec.training.steps * replicas * spec.data.batch_size
    reference = single_process(spec, replicas)
    assert max_abs_diff(result.model, reference) <= TOLERANCE


def test_sync_differs_from_a_wrong_data_order(inproc_client, tmp_path):
    """The fidelity check has teeth: the same run differs from single-process training with a
    batch of another size (another data order)."""
    spec = sync_spec(1, 2, "sgd", steps=20)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE
    assert max_abs_diff(result.model, single_process(spec, 1, steps=20)) > 1e-3


def test_microbatches_without_stages_are_gradient_accumulation(inproc_client, tmp_path):
    """training.microbatches with one stage: each replica runs its batch of 8 in 4 parts before one
    push, and the run equals single-process training on the whole batches (fails if the parts'
    losses are not weighted by their share, i.e. 4x the gradient, or if a part's gradient is lost).
    The bytes cross the socket (no shared memory) with a bucket size that would send buckets during
    backward: bucketing is off with micro-batches, else the first part's partial gradient would be
    sent as the step's."""
    spec = sync_spec(2, 2, "momentum", steps=30)
    spec.training.microbatches = 4
    spec.training.shared_memory = False
    spec.training.bucket_mb = 0.001
    plan = dtrain.compile(spec)
    assert not plan.stages
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == 30
    assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE


def test_backup_replicas_do_not_wait_for_a_straggler(inproc_client, tmp_path):
    """3 replicas, aggregate 2, replica 2 sleeps 0.1 s in every forward (the others 5 ms, so the
    60 steps outlast the straggler's first pushes): the two fast replicas carry every step, the
    straggler's late gradients are dropped."""
    slow = {"module": "tests.helpers.slowmodels:SlowMLP",
            "kwargs": {"delay_s": 0.1, "fast_delay_s": 0.005, "slow_worker": "worker-2"}}
    spec = dtrain.loads(pipeline_yaml(
        "backup", jobs={"ps": 1, "worker": 3}, model=slow, data={"source": "sklearn:digits", "batch_size": 8},
        training={"mode": "sync", "total_num_replicas": 3, "replicas_to_aggregate": 2, "steps": 60},
        summary={"every_steps": 50, "tensorboard": False}), base_dir=".")
    with connect(spec, client=inproc_client) as conn, conn.client.as_current():
        session = Session(spec, conn, tmp_path / "run")
        result = session.run()
    s = result.summary
    assert s["status"] == "completed"
    assert s["global_step"] == spec.training.steps
    assert s["replicas"] == 3
    assert s["dropped_stale"] > 0
    local = {st["replica"]: st["local_steps"] for st in session.replica_stats}
    assert {st["worker"] for st in session.replica_stats if st["replica"] == 2} == {"worker-2"}
    # The fast replicas computed (almost) every step; the straggler only a fraction of them.
    assert local[2] < min(local[0], local[1])
    assert local[2] <= spec.training.steps // 2
    assert local[0] + local[1] >= 2 * spec.training.steps - local[2]


def test_sync_digits_reaches_accuracy(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "digits_sync.yaml", overrides=["summary.tensorboard=false"])
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert result.summary["eval"]["accuracy"] >= 0.95


def test_bounded_staleness_digits_reaches_accuracy(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "digits_staleness.yaml",
                       overrides=["summary.tensorboard=false", "training.steps=600"])
    assert spec.training.mode == "async" and spec.training.max_staleness == 2
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed"
    assert s["global_step"] >= spec.training.steps
    assert s["eval"]["accuracy"] >= 0.95


@pytest.mark.parametrize("name", ["digits_staleness.yaml", "digits_in_graph.yaml", "digits_backup.yaml"])
def test_new_pipelines_validate_and_compile(name):
    spec = dtrain.load(PIPELINES / name)
    plan = dtrain.compile(spec)
    assert not plan.missing_tasks
    if name == "digits_backup.yaml":
        assert plan.num_replicas == 3 and plan.replicas_to_aggregate == 2
    if name == "digits_in_graph.yaml":
        assert plan.replication == "in_graph" and plan.mode == "sync"
