"""In-graph sync replication over towers (dtrain.chief.ingraph_tower_driver, dtrain.worker.ingraph_tower_actor)
on the in-process cluster: the graph built once, each step run by the coordinator over the data
plane; and the graph path (one Dask graph per step) where towers do not apply."""

from __future__ import annotations

import pytest
from distributed import get_task_stream

import dtrain
from dtrain.chief.ingraph import InGraphDriver
from dtrain.chief.ingraph_tower_driver import TowerDriver
from dtrain.plan.job import replica_job
from dtrain.worker.ingraph_tower_actor import Tower, close_plane, open_plane
from tests.helpers.ingraph import TOLERANCE, driver_for, in_graph_spec, shards_for, trained_model
from tests.helpers.reference import max_abs_diff, single_process
from tests.helpers.waiting import wait_until


def _ig_tasks(task_stream) -> list[str]:
    return [str(r["key"]) for r in task_stream.data if str(r["key"]).startswith("dtrain-ig-")]


def test_in_graph_sync_runs_a_constant_number_of_tasks_and_leaves_no_tower(inproc_client, tmp_path):
    """The towers take every step: 10 and 40 steps submit the same tasks (fails if a step is a
    Dask graph again, as on the graph path), and the towers are gone after the run (fails if the
    driver leaks its actors)."""
    counts = []
    for steps in (10, 40):
        spec = in_graph_spec(1, 2, steps=steps)
        with get_task_stream(inproc_client) as ts:
            result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / f"run{steps}")
        assert result.summary["status"] == "completed" and result.summary["global_step"] == steps
        assert max_abs_diff(result.model, single_process(spec, 2)) <= TOLERANCE
        keys = _ig_tasks(ts)
        assert sum(k.startswith("dtrain-ig-tower") for k in keys) == 2, keys
        counts.append(len(keys))
    assert counts[0] == counts[1]
    left = inproc_client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors if "dtrain-ig-" in str(k)])
    assert not any(left.values()), left


def test_the_session_chooses_towers_or_the_graph_path(inproc_client, tmp_path):
    """Towers on the socket data plane; the graph path on transport: dask (and it still equals
    single-process training there). Fails if the choice is inverted or the graph path broke."""
    spec = in_graph_spec(2, 2, steps=20)
    with shards_for(inproc_client, spec, tmp_path) as shards:
        assert type(driver_for(shards)) is TowerDriver
    dask_spec = in_graph_spec(2, 2, steps=20, training={"transport": "dask"})
    with shards_for(inproc_client, dask_spec, tmp_path) as shards:
        driver = driver_for(shards)
        assert type(driver) is InGraphDriver
        driver.start()
        assert driver.join(timeout=120) and driver.error() is None
        assert driver.global_step == 20
        model = trained_model(shards)
    assert max_abs_diff(model, single_process(dask_spec, 2)) <= TOLERANCE


def test_a_tower_runs_the_steps_in_order_whatever_order_they_arrive_in(inproc_client, tmp_path):
    """Two steps are in flight to each tower, and their messages may overtake each other: step 1
    sent before step 0 still runs after it (a tower that ran them as they came would wait for step
    1's parameters forever, with step 0 queued behind it), and a step sent twice is refused."""
    spec = in_graph_spec(1, 1, steps=2, training={"barrier_timeout_s": 5})
    spec.training.call_timeout_s = 5
    client = inproc_client
    with shards_for(client, spec, tmp_path) as shards:
        (ps, key), = shards.refs()
        worker = shards.conn.tasks[shards.plan.replicas[0].task]
        secret = b"tower-test-secret"
        endpoint = client.submit(open_plane, key, secret, "127.0.0.1", None, 10, workers=[ps], pure=False).result(10)
        plane = {"endpoints": [tuple(endpoint)], "secret": secret, "tls": None, "wire_dtype": "float32",
                 "shared_memory": True}
        future = client.submit(Tower, replica_job(spec, shards.plan, 0), plane, 0, actor=True, workers=[worker],
                               pure=False)
        tower = future.result(30)
        # The actor itself (in this process): step 1 has reached it once its turn condition exists,
        # made by the first call on the worker's loop before that call yields to anything else.
        actor = client.cluster.workers["worker-0"].state.actors[future.key]
        try:
            second = tower.step(1)
            wait_until(lambda: actor._turn is not None, 30, "step 1 waiting for its turn", every=0.005)
            assert actor._turn is not None and not second.done()  # step 1 waits for step 0's turn
            first = tower.step(0)
            (a,), (b,) = first.result(timeout=30), second.result(timeout=30)
            assert (a["version"], a["steps"], b["version"], b["steps"]) == (0, [1], 1, [2])
            assert b["stop"]  # step 2 is training.steps
            with pytest.raises(RuntimeError, match="sent step 0 after step 1"):
                tower.step(0).result(timeout=30)
            info = tower.close().result(timeout=30)
            assert info["worker"] == "worker-0" and info["buffers"] == {}
        finally:
            client.cancel([future], force=True)
            client.submit(close_plane, key, workers=[ps], pure=False).result(10)
        model = trained_model(shards)
    assert max_abs_diff(model, single_process(spec, 1)) <= TOLERANCE


def test_towers_over_the_socket_with_buckets_match_single_process(inproc_client, tmp_path):
    """No shared memory (the bytes cross the socket, as between machines) and gradient buckets
    sent during backward: still single-process training with batch N*b (fails if a tower sends
    a wrong head or a bucket lands at a wrong offset)."""
    spec = in_graph_spec(2, 2, steps=30, training={"shared_memory": False, "bucket_mb": 0.001})
    with shards_for(inproc_client, spec, tmp_path) as shards:
        driver = driver_for(shards)
        assert type(driver) is TowerDriver
        driver.start()
        assert driver.join(timeout=120) and driver.error() is None and driver.global_step == 30
        model = trained_model(shards)
    assert max_abs_diff(model, single_process(spec, 2)) <= TOLERANCE
