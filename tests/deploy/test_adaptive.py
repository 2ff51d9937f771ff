"""``cluster.adaptive``: Dask's adaptive scaling of the embedded cluster's replica workers
(dtrain/deploy/adaptive.py). The embedded cluster starts with the ps workers and ``min`` replica
workers, grows to ``max`` (each added worker takes a free slot: an elastic join), retires idle
workers but never a ps worker holding the run's state, and reuses the slot names. In-process
embedded clusters (``processes=False``): the scaling is the same with worker processes."""

from __future__ import annotations

import time

import pytest
from distributed import Client, Event, LocalCluster

import dtrain
from dtrain.deploy.cluster import connect, worker_specs
from dtrain.spec.errors import SpecError
from tests.helpers.paths import PIPELINES

PIPELINE = PIPELINES / "digits_adaptive.yaml"  # ps: 1, worker: {min: 1, max: 3}, adaptive: {min: 1, max: 3}


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def test_digits_starts_with_min_replica_workers_and_dask_adds_the_rest(tmp_path):
    """The run starts on 1 replica worker; Dask's Adaptive adds 2 more, which join as replicas (a
    cluster started at its max, or an Adaptive that never grows, counts no join), and the run
    completes every step to the pipeline's accuracy with no recovery."""
    spec = dtrain.load(PIPELINE, overrides=["summary.tensorboard=false", "checkpoint=null", "eval={}"])
    assert list(worker_specs(spec, processes=False)) == ["ps-0", "worker-0"]
    seen: list[dict] = []
    result = dtrain.run(spec, run_dir=tmp_path / "run", processes=False, progress=seen.append)
    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == spec.training.steps
    assert s["eval"]["accuracy"] >= 0.95, s["eval"]
    assert (s["replicas_joined"], s["replicas_left"], s["replicas_max"], s["recoveries"]) == (2, 0, 3, 0)
    assert sorted(e["replica"] for e in s["elastic_log"] if e["event"] == "join") == [1, 2]
    assert seen[-1]["replicas"] == 3 and seen[-1]["step"] == spec.training.steps  # the last record: the last step


def test_adaptive_retires_idle_workers_keeps_a_busy_ps_and_reuses_slot_names():
    spec = dtrain.load(PIPELINE, overrides=["cluster.adaptive.interval_s=0.1"])
    with connect(spec, processes=False) as conn:
        def names() -> list[str]:
            return sorted(str(w["name"]) for w in conn.workers().values())

        _until(lambda: names() == ["ps-0", "worker-0", "worker-1", "worker-2"], "growth to 3 replica workers")
        ps = next(a for a, w in conn.workers().items() if w["name"] == "ps-0")
        hold = Event("dtrain-test-hold", client=conn.client)
        # a dtrain task on ps-0 (as a ps shard's actor or a replica would be): KeepRunTasks guards it
        busy = conn.client.submit(lambda: hold.wait(60), key="dtrain-test-busy", workers=[ps], pure=False)
        _until(lambda: busy.status == "pending" and conn.client.processing().get(ps), "the busy task running")
        # No run here: the replica slots' demand is set by hand (the runs above and the elastic tests
        # drive dtrain's own demand); what is tested is which workers a scale-down retires and
        # which names a growth reuses.
        conn.adaptive.demand = lambda: 1  # one replica slot with work: the ps worker and one replica worker
        _until(lambda: len(names()) == 2, "a scale-down to 2 workers")
        assert "ps-0" in names()
        conn.adaptive.demand = lambda: 3
        _until(lambda: len(names()) == 4, "growth back to 3 replica workers")
        assert names() == ["ps-0", "worker-0", "worker-1", "worker-2"]  # the slots' names again
        hold.set()
        busy.result(timeout=30)


def test_dtrain_adapt_scales_a_local_cluster_of_yours(tmp_path):
    """dtrain.adapt(cluster, spec): the same scaling on a LocalCluster the user holds, with Dask's
    default worker names (automatic assignment). It starts with the ps and 1 replica worker and
    grows to the job's max of 4 replicas: 3 joins (Dask's own Adaptive adds none for a training
    job, so plain cluster.adapt() would count 0)."""
    spec = dtrain.load(PIPELINES / "digits_elastic.yaml", overrides=["summary.tensorboard=false", "checkpoint=null",
                                                                     "eval={}"])
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, host="127.0.0.1", protocol="tcp://",
                      dashboard_address=None) as cluster, Client(cluster, set_as_default=False) as client:
        with pytest.raises(ValueError, match="must lie within"):
            dtrain.adapt(cluster, spec, minimum=1, maximum=5)
        dtrain.adapt(cluster, spec, interval=0.2)
        result = dtrain.run(spec, client=client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == spec.training.steps
    assert s["eval"]["accuracy"] >= 0.95, s["eval"]
    assert (s["replicas_joined"], s["replicas_max"], s["recoveries"]) == (3, 4, 0)


def test_adaptive_on_a_cluster_of_yours_is_refused(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINE)
    with pytest.raises(SpecError) as info:
        dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert [p.path for p in info.value.problems] == ["cluster.adaptive"]
    assert "call that cluster's adapt()" in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_key_of_the_embedded_cluster_on_a_cluster_of_yours_is_refused(inproc_client, tmp_path):
    """cluster.nthreads (like memory_limit, dashboard, start_method) sizes the embedded cluster's
    processes; given a client, the run is on that cluster's workers: refused before anything starts."""
    spec = dtrain.load(PIPELINES / "digits_async.yaml", overrides=["cluster.nthreads=4", "cluster.dashboard=false"])
    with pytest.raises(SpecError) as info:
        dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert [p.path for p in info.value.problems] == ["cluster.nthreads", "cluster.dashboard"]
    assert "this run is on the cluster of the client given (client=)" in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
