"""In-graph asynchronous replication (dtrain.chief.ingraph_async.AsyncInGraphDriver) on the
in-process cluster: the chief builds each tower step's graph, every push is applied on arrival,
towers progress independently, the global step counts the applied pushes."""

from __future__ import annotations

from distributed import get_task_stream

import dtrain
from dtrain.chief import checkpoint
from dtrain.chief.drivers import new_driver
from dtrain.chief.ingraph_async import AsyncInGraphDriver
from tests.helpers.ingraph import shard_steps, shards_for
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import mlp, pipeline_yaml
from tests.helpers.waiting import wait_until

# Tower 1 (worker task 1, the in-process worker-1) sleeps in every forward: a straggler.
SLOW = {"module": "tests.helpers.slowmodels:SlowMLP", "kwargs": {"slow_worker": "worker-1", "delay_s": 0.4}}


def async_spec(num_ps: int, replicas: int, steps: int, model: dict | None = None, **sections) -> dtrain.PipelineSpec:
    return dtrain.loads(pipeline_yaml(
        "in-graph-async", jobs={"ps": num_ps, "worker": replicas}, model=model or mlp(),
        data={"source": "sklearn:digits", "batch_size": 8},
        training={"replication": "in_graph", "mode": "async", "steps": steps, "seed": 5, "call_timeout_s": 30},
        **sections), base_dir=".")


def run_driver(shards, spec=None) -> AsyncInGraphDriver:
    driver = new_driver(shards.client, spec or shards.spec, shards.plan, shards.refs(), shards.conn.tasks, shards.token)
    assert isinstance(driver, AsyncInGraphDriver)
    driver.start()
    assert driver.join(timeout=240), "the in-graph async driver did not finish"
    assert driver.error() is None, driver.error()
    return driver


def test_towers_progress_independently_and_every_push_is_one_global_step(inproc_client, tmp_path):
    """With tower 1 slowed, tower 0 keeps pushing: their step counts differ (a sync step needs
    every tower, so there they are equal), and the global step is the sum of the applied pushes."""
    steps = 60
    spec = async_spec(1, 2, steps, model=SLOW)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = run_driver(shards)
        assert shard_steps(shards) == [steps] and driver.global_step == steps
        stats = shards.handles[0].stats().result(timeout=10)
        load = shards.handles[0].load().result(timeout=10)
    fast, slow = (r["local_steps"] for r in driver.replica_stats())
    assert fast + slow == steps  # one global step per applied push, none averaged
    assert slow >= 1 and fast >= 1.5 * slow, (fast, slow)  # sync: equal (every step needs both)
    assert stats["samples"] == steps * 8 and stats["dropped_stale"] == 0
    assert stats["local_steps"] == {0: fast, 1: slow}  # what a checkpoint keeps for a resume
    # Every push was applied on arrival, many on parameters another tower had moved since its read.
    assert load["applies"] == steps and load["pushes"] >= steps
    assert load["staleness"]["max"] >= 1


def test_two_shards_apply_each_push_once(inproc_client, tmp_path):
    steps = 40
    spec = async_spec(2, 2, steps)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = run_driver(shards)
        first, second = shard_steps(shards)
        loads = [h.load().result(timeout=10) for h in shards.handles]
    # Shard 0 counts the global step and stops there; a push in flight at that moment may still be
    # applied by shard 1 (one more per other tower at most), as with between-graph async replicas.
    assert first == steps and steps <= second <= steps + 1
    assert sum(r["local_steps"] for r in driver.replica_stats()) == steps
    assert [ld["applies"] for ld in loads] == [first, second]
    assert [r["worker"] for r in driver.replica_stats()] == ["worker-0", "worker-1"]


def test_stop_ends_after_the_steps_in_flight_with_every_push_counted(inproc_client, tmp_path):
    spec = async_spec(1, 3, 100_000)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = new_driver(inproc_client, spec, shards.plan, shards.refs(), shards.conn.tasks, shards.token)
        driver.start()
        wait_until(lambda: driver.global_step >= 6 or driver.done(), 60, "step 6")
        driver.stop()
        assert driver.join(timeout=60) and driver.error() is None
        assert shard_steps(shards) == [driver.global_step]
    assert driver.global_step >= 6
    assert sum(r["local_steps"] for r in driver.replica_stats()) == driver.global_step


def test_a_failing_gradient_task_names_the_tower(inproc_client, tmp_path):
    spec = async_spec(1, 2, 10, model={"module": "tests.helpers.models:BrokenMLP"})
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = new_driver(inproc_client, spec, shards.plan, shards.refs(), shards.conn.tasks, shards.token)
        driver.start()
        assert driver.join(timeout=60)
        err = driver.error()
        assert err is not None and "gradient task failed" in err and "tower " in err
        assert "mat1 and mat2" in err  # torch's own shape error names the cause
        assert shard_steps(shards) == [0]


def _ran_in_graph(task_stream) -> bool:
    keys = [str(r["key"]) for r in task_stream.data]
    return any(k.startswith("dtrain-ig-grad") for k in keys) and not any(k.startswith("dtrain-replica-") for k in keys)


def test_in_graph_async_digits_pipeline_reaches_accuracy(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "digits_in_graph_async.yaml",
                       overrides=["summary.tensorboard=false", "training.steps=250"])
    with get_task_stream(inproc_client) as ts:
        result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed" and s["mode"] == "async" and s["replication"] == "in_graph"
    assert s["global_step"] == 250
    assert sum(r["local_steps"] for r in result.replica_stats) == 250
    assert s["eval"]["accuracy"] >= 0.95  # the sync in-graph pipeline's threshold
    assert _ran_in_graph(ts)


def test_stop_at_step_checkpoints_and_resume(inproc_client, tmp_path):
    """A stop_at_step hook ends the towers at that global step; the checkpoint keeps each tower's
    pushes, and a resumed run continues both the global step and each tower's data order."""
    run_dir = tmp_path / "run"
    spec = async_spec(1, 2, 40, checkpoint={"every_steps": 10}, hooks=[{"type": "stop_at_step", "last_step": 20}])
    first = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert first.summary["status"] == "completed" and first.summary["global_step"] == 20
    ckpt = checkpoint.latest(run_dir).payload
    local = {int(k): v for k, v in ckpt["replicas"]["local_steps"].items()}
    assert ckpt["step"] == 20 and sum(local.values()) == 20
    resumed = dtrain.run(async_spec(1, 2, 40), client=inproc_client, run_dir=run_dir, resume=True)
    assert resumed.summary["status"] == "completed"
    assert resumed.summary["start_step"] == 20 and resumed.summary["global_step"] == 40
    assert sum(r["local_steps"] for r in resumed.replica_stats) == 20
