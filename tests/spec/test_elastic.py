"""Elastic replicas as the spec states them (``cluster.jobs.worker: {min, max}``): the slots they
give, and the combinations refused with the key and the fix."""

from __future__ import annotations

from typing import Any

import pytest

import dtrain
from dtrain.spec.elastic import adaptive_bounds, elastic_of
from dtrain.spec.elastic_jobs import ElasticJob
from dtrain.spec.errors import SpecError
from dtrain.spec.loading import validate

MODEL = {"input_shape": [4], "layers": [{"type": "linear", "out": 3}]}


def spec(jobs: dict[str, Any], **training: Any):
    return validate({"model": MODEL, "cluster": {"jobs": jobs}, "training": {"mode": "async", **training}})


def problems(jobs: dict[str, Any], **training: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec(jobs, **training)
    return [(p.path, p.message) for p in info.value.problems]


def test_min_max_gives_max_slots():
    s = spec({"ps": 1, "worker": {"min": 2, "max": 5}})
    assert elastic_of(s) == ElasticJob(min=2, max=5)
    assert s.cluster.num_tasks("worker") == 5 and s.num_replicas() == 5
    assert s.cluster.task_workers("worker") == [f"worker-{i}" for i in range(5)]
    plan = dtrain.compile(s)
    assert plan.replicas_min == 2 and plan.num_replicas == 5
    assert "(elastic: 2 to 5 live)" in plan.format().splitlines()[0]
    assert elastic_of(spec({"ps": 1, "worker": 3})) is None and dtrain.compile(spec({"ps": 1, "worker": 3})).replicas_min is None


@pytest.mark.parametrize(("bounds", "message"), [
    ({"min": 3, "max": 2}, "max (2) is below min (3)"),
    ({"min": 0, "max": 2}, "must be >= 1, got 0"),
    ({"min": 1}, "max"),
    ({"min": 1, "max": 2, "step": 1}, "step"),
])
def test_bad_bounds(bounds, message):
    found = problems({"ps": 1, "worker": bounds})
    assert any(path.startswith("cluster.jobs.worker") and message in msg for path, msg in found), found


def test_sync_is_elastic_with_every_live_replica_in_the_quorum():
    s = spec({"ps": 1, "worker": {"min": 1, "max": 3}}, mode="sync")
    assert s.replicas_to_aggregate() == 3 and dtrain.compile(s).replicas_min == 1


def test_only_the_replicas_job_is_elastic():
    found = problems({"ps": {"min": 1, "max": 2}, "worker": 2})
    assert ("cluster.jobs.ps", "only the replicas' job ('worker') can be elastic ({min, max}): ps tasks hold the "
            "variables and stay fixed; give a number") in found


@pytest.mark.parametrize(("training", "path", "fix"), [
    ({"mode": "sync", "replicas_to_aggregate": 1}, "training.replicas_to_aggregate", "give a fraction of them"),
    ({"mode": "sync", "replication": "in_graph"}, "cluster.jobs.worker", "between_graph"),
    ({"total_num_replicas": 2}, "training.total_num_replicas", "remove total_num_replicas"),
    ({"max_staleness": 3}, "training.max_staleness", "remove it"),
])
def test_unsupported_combinations_name_the_fix(training, path, fix):
    found = problems({"ps": 1, "worker": {"min": 1, "max": 3}}, **training)
    assert any(p == path and fix in msg for p, msg in found), found


@pytest.mark.parametrize(("value", "fixed", "fraction"), [(None, 4, 1.0), ("all", 4, 1.0), (0.75, 3, 0.75),
                                                          (0.1, 1, 0.1), (2, 2, None)])
def test_replicas_to_aggregate_as_a_count_a_fraction_or_all(value, fixed, fraction):
    s = validate({"model": MODEL, "cluster": {"jobs": {"ps": 1, "worker": 4}},
                  "training": {"mode": "sync", "replicas_to_aggregate": value}})
    assert s.replicas_to_aggregate() == fixed and s.aggregate_fraction() == fraction
    assert dtrain.compile(s).aggregate_fraction is None  # a fixed job: the count goes to the ps
    if fraction is not None:
        e = spec({"ps": 1, "worker": {"min": 1, "max": 4}}, mode="sync", replicas_to_aggregate=value)
        assert dtrain.compile(e).aggregate_fraction == fraction


@pytest.mark.parametrize(("value", "message"), [(0, "must be >= 1, got 0"), (1.5, "must be <= 1, got 1.5"),
                                                ("most", "allowed values")])
def test_bad_replicas_to_aggregate(value, message):
    with pytest.raises(SpecError) as info:
        validate({"model": MODEL, "training": {"mode": "sync", "replicas_to_aggregate": value}})
    assert any(p.path == "training.replicas_to_aggregate" and message in p.message for p in info.value.problems)


def test_sharded_sources_need_fixed_replicas(tmp_path):
    import numpy as np

    np.savez(tmp_path / "part-0.npz", x=np.zeros((64, 4), dtype=np.float32), y=np.zeros(64, dtype=np.int64))
    with pytest.raises(SpecError) as info:
        validate({"model": MODEL, "cluster": {"jobs": {"ps": 1, "worker": {"min": 1, "max": 2}}},
                  "data": {"source": str(tmp_path / "*.npz")}, "training": {"mode": "async"}})
    assert any(p.path == "cluster.jobs.worker" and "give the job a number of tasks" in p.message
               for p in info.value.problems), info.value.problems


def _adaptive(jobs: dict[str, Any], adaptive: dict[str, Any], **cluster: Any):
    return validate({"model": MODEL, "cluster": {"jobs": jobs, "adaptive": adaptive, **cluster},
                     "training": {"mode": "async"}})


def test_adaptive_bounds_default_to_the_elastic_job():
    assert adaptive_bounds(_adaptive({"ps": 1, "worker": {"min": 2, "max": 5}}, {})) == (2, 5)
    assert adaptive_bounds(_adaptive({"ps": 1, "worker": {"min": 1, "max": 5}}, {"min": 2, "max": 3})) == (2, 3)
    assert adaptive_bounds(spec({"ps": 1, "worker": {"min": 1, "max": 5}})) is None


@pytest.mark.parametrize(("jobs", "adaptive", "cluster", "message"), [
    ({"ps": 1, "worker": 3}, {}, {}, "the replicas' job must be elastic"),
    ({"ps": 1, "worker": {"min": 2, "max": 4}}, {"min": 1}, {}, "min 1 and max 4 must lie within"),
    ({"ps": 1, "worker": {"min": 2, "max": 4}}, {"max": 5}, {}, "min 2 and max 5 must lie within"),
    ({"ps": 1, "worker": {"min": 1, "max": 4}}, {}, {"scheduler": "tcp://10.0.0.5:8786"}, "call that cluster's adapt()"),
])
def test_adaptive_problems_name_the_fix(jobs, adaptive, cluster, message):
    with pytest.raises(SpecError) as info:
        _adaptive(jobs, adaptive, **cluster)
    assert [(p.path, message in p.message) for p in info.value.problems] == [("cluster.adaptive", True)]
