"""In-graph replication (dtrain.chief.ingraph.InGraphDriver) on the in-process cluster: one Dask graph
per step, numerically the same as single-process training with the global batch."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest
from distributed import get_task_stream

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.worker.replica import ReplicaStats
from tests.helpers.ingraph import TOLERANCE, driver_for, in_graph_spec, shard_steps, shards_for, trained_model
from tests.helpers.paths import PIPELINES
from tests.helpers.reference import max_abs_diff, single_process
from tests.helpers.waiting import wait_until


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
    wait_until(lambda: driver.global_step >= until_step or driver.done(), 60, f"step {until_step}")
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
        wait_until(lambda: driver.global_step >= 3 or driver.done(), 60, "step 3")
        shards.request_stop()  # what the session does at a stop hook or a failure
        assert driver.join(timeout=60)
        assert driver.error() is None
        assert shard_steps(shards) == [driver.global_step]


def test_in_graph_reports_a_failing_gradient_task(inproc_client, tmp_path):
    spec = in_graph_spec(1, 2, steps=10, model={"module": "tests.helpers.models:BrokenMLP"})
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
    spec = in_graph_spec(2, 2, steps=30, checkpoint={"every_steps": 10, "keep": 5})
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
