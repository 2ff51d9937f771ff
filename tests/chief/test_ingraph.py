"""In-graph replication (dtrain.chief.ingraph.InGraphDriver) on the in-process cluster: one Dask graph
per step, numerically the same as single-process training with the global batch."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, fields

import pytest
import torch
from distributed import get_task_stream

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.chief.drivers import new_driver
from dtrain.chief.ingraph import InGraphDriver
from dtrain.chief.ps_shards import ShardGroup
from dtrain.deploy.cluster import Connection, wait_for_tasks
from dtrain.plan.layout import ShardLayout
from dtrain.worker.replica import ReplicaStats
from tests.helpers.paths import PIPELINES
from tests.helpers.reference import max_abs_diff, single_process

TOLERANCE = 1e-5
OPTIMIZERS = {"sgd": "{name: sgd, lr: 0.1}", "momentum": "{name: momentum, lr: 0.05, momentum: 0.9}",
              "adam": "{name: adam, lr: 0.01}"}


def in_graph_spec(num_ps: int, replicas: int, steps: int, optimizer: str = "sgd",
                  model: str = "input_shape: [64]\n  layers: [{type: linear, out: 16}, {type: relu}, "
                               "{type: linear, out: 10}]", extra: str = "", training: str = "") -> dtrain.PipelineSpec:
    return dtrain.loads(f"""
name: in-graph
cluster: {{jobs: {{ps: {num_ps}, worker: {replicas}}}}}
model:
  {model}
data: {{source: sklearn:digits, batch_size: 8}}
optimizer: {OPTIMIZERS[optimizer]}
training: {{replication: in_graph, mode: sync, steps: {steps}, seed: 5, call_timeout_s: 30{", " + training if training else ""}}}
summary: {{every_steps: 50, tensorboard: false}}
{extra}
""", base_dir=".")


@contextlib.contextmanager
def shards_for(client, spec: dtrain.PipelineSpec, tmp_path) -> Iterator[ShardGroup]:
    """The run's ps actors, created and initialised as ``Session.run`` does, then removed."""
    conn = Connection(client)
    wait_for_tasks(conn, spec, 30)
    with client.as_current():
        plan = dtrain.compile(spec, conn.workers())
        group = ShardGroup(conn, spec, plan, token=uuid.uuid4().hex[:8])
        group.create(ShardLayout.from_plan(plan).pack(dict(dtrain.build_model(spec).named_parameters())))
        try:
            yield group
        finally:
            group.request_stop()
            client.cancel(group.futures, force=True)


def driver_for(group: ShardGroup, spec: dtrain.PipelineSpec | None = None) -> InGraphDriver:
    """The driver the session would start (towers on the socket data plane, else one graph per step)."""
    return new_driver(group.client, spec or group.spec, group.plan, group.refs(), group.conn.tasks, group.token)


def trained_model(group: ShardGroup) -> torch.nn.Module:
    model = dtrain.build_model(group.spec)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    model.load_state_dict(ShardLayout.from_plan(group.plan).unpack(group.pull_params(), shapes))
    return model


def shard_steps(group: ShardGroup) -> list[int]:
    return [s.get_params().result(timeout=10)[1] for s in group.handles]


@pytest.mark.parametrize(("num_ps", "replicas", "optimizer", "steps"), [
    (1, 2, "sgd", 100), (2, 2, "sgd", 100), (1, 3, "momentum", 40), (2, 3, "adam", 40)])
def test_in_graph_matches_single_process_training(inproc_client, tmp_path, num_ps, replicas, optimizer, steps):
    spec = in_graph_spec(num_ps, replicas, steps=steps, optimizer=optimizer)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        assert len(shards.plan.shards) == num_ps
        driver = driver_for(shards)
        driver.start()
        assert driver.join(timeout=240), "the in-graph driver did not finish"
        assert driver.done() and driver.error() is None
        assert shard_steps(shards) == [steps] * num_ps
        assert driver.global_step == steps
        stats = shards.handles[0].stats().result(timeout=10)
        assert stats["dropped_stale"] == 0 and stats["samples"] == steps * replicas * 8
        model = trained_model(shards)
    assert max_abs_diff(model, single_process(spec, replicas)) <= TOLERANCE

    rows = driver.replica_stats()
    assert [r["replica"] for r in rows] == list(range(replicas))
    assert {f.name for f in fields(ReplicaStats)} <= rows[0].keys()
    assert rows[0].keys() - asdict(ReplicaStats(0)).keys() == {"worker", "pid"}
    for r in rows:
        assert r["local_steps"] == steps and r["samples"] == steps * 8 and r["final_step"] == steps
        assert r["device"] == "cpu" and r["compute_s"] > 0 and r["wall_s"] >= r["compute_s"]
    assert [r["worker"] for r in rows] == [f"worker-{i}" for i in range(replicas)]
    assert rows[0]["extra"]["buffers"] == {}  # the MLP has no non-parameter buffers
    assert rows[0]["extra"].keys() <= {"buffers", "idle_s"}  # (idle_s: a tower's wait for its next step)


def test_in_graph_resumes_where_the_shards_are(inproc_client, tmp_path):
    """A second driver (as after a recovery) continues from the shards' step, with the data
    order of that step: 20 + 20 steps equal 40 single-process steps."""
    spec = in_graph_spec(2, 2, steps=40)
    first_half = spec.model_copy(deep=True)
    first_half.training.steps = 20
    with shards_for(inproc_client, spec, tmp_path) as shards:
        first = driver_for(shards, first_half)
        first.start()
        assert first.join(timeout=120) and first.error() is None
        assert shard_steps(shards) == [20, 20]
        second = driver_for(shards)
        second.start()
        assert second.join(timeout=120) and second.error() is None
        assert shard_steps(shards) == [40, 40]
        assert [r["local_steps"] for r in second.replica_stats()] == [20, 20]
        model = trained_model(shards)
    assert max_abs_diff(model, single_process(spec, 2)) <= TOLERANCE


def started_driver(shards, until_step: int):
    """A running InGraphDriver, once it has applied ``until_step`` steps (or 60 s passed)."""
    driver = driver_for(shards)
    driver.start()
    deadline = time.monotonic() + 60
    while driver.global_step < until_step and time.monotonic() < deadline and not driver.done():
        time.sleep(0.05)
    return driver


def test_in_graph_stops_on_request_with_every_shard_at_one_step(inproc_client, tmp_path):
    spec = in_graph_spec(2, 2, steps=100_000)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = started_driver(shards, until_step=5)
        driver.stop()
        assert driver.join(timeout=60)
        assert driver.error() is None
        steps = shard_steps(shards)
        assert steps[0] == steps[1] == driver.global_step >= 5
        assert all(r["local_steps"] == driver.global_step for r in driver.replica_stats())


def test_in_graph_ends_when_the_session_stops_the_shards(inproc_client, tmp_path):
    spec = in_graph_spec(1, 2, steps=100_000)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = driver_for(shards)
        driver.start()
        deadline = time.monotonic() + 60
        while driver.global_step < 3 and time.monotonic() < deadline and not driver.done():
            time.sleep(0.05)
        shards.request_stop()  # what the session does at a stop hook or a failure
        assert driver.join(timeout=60)
        assert driver.error() is None
        assert shard_steps(shards) == [driver.global_step]


def test_in_graph_reports_a_failing_gradient_task(inproc_client, tmp_path):
    spec = in_graph_spec(1, 2, steps=10, model='module: "tests.helpers.models:BrokenMLP"')
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = driver_for(shards)
        driver.start()
        assert driver.join(timeout=60)
        err = driver.error()
        assert err is not None and "in-graph step 0" in err and "grad" in err
        assert "mat1 and mat2" in err  # torch's own shape error names the cause
        assert shard_steps(shards) == [0]


def _ran_in_graph(task_stream) -> bool:
    """The session ran in-graph replication (its towers, or its step graphs' gradient tasks), not
    between-graph replica loops."""
    keys = [str(r["key"]) for r in task_stream.data]
    return any(k.startswith(("dtrain-ig-tower", "dtrain-ig-grad")) for k in keys) \
        and not any(k.startswith("dtrain-replica-") for k in keys)


def test_in_graph_through_dtrain_run_matches_single_process(inproc_client, tmp_path):
    spec = in_graph_spec(2, 2, steps=30)
    with get_task_stream(inproc_client) as ts:
        result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == 30 and s["replication"] == "in_graph"
    assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE
    assert _ran_in_graph(ts)


def test_in_graph_digits_pipeline_reaches_accuracy(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "digits_in_graph.yaml",
                       overrides=["summary.tensorboard=false", "training.steps=250"])
    with get_task_stream(inproc_client) as ts:
        result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert result.summary["eval"]["accuracy"] >= 0.95
    assert _ran_in_graph(ts)


def test_in_graph_checkpoints_pause_applies_without_changing_the_result(inproc_client, tmp_path):
    """Checkpoint snapshots hold the shards (apply_mean waits like a push); the run still equals
    single-process training."""
    spec = in_graph_spec(2, 2, steps=30, extra="checkpoint: {every_steps: 10, keep: 5}")
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 30
    assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert len(names) >= 2  # (the session saves when its poll sees every_steps passed)


def test_in_graph_abort_ends_without_an_error(inproc_client, tmp_path):
    spec = in_graph_spec(1, 2, steps=100_000)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = started_driver(shards, until_step=3)
        driver.abort()
        assert driver.join(timeout=60)
        assert driver.error() is None
        assert shard_steps(shards)[0] >= driver.global_step >= 3
