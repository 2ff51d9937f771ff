"""training.overlap's default: on in async between-graph mode, where a replica computes its next
step while its push is in flight (one of its own steps staler), off with ``overlap: false``, where
one async replica is exactly plain SGD."""

from __future__ import annotations

import pytest

import dtrain
from dtrain.spec.sections import TrainingSpec
from tests.helpers.pipelines import pipeline_yaml
from tests.helpers.reference import max_abs_diff, single_process

SPEC = pipeline_yaml("overlap", jobs={"ps": 1, "worker": 1}, training={"mode": "async", "steps": 30, "seed": 5})


@pytest.mark.parametrize(("keys", "expected"), [
    ({"mode": "async"}, True),
    ({"mode": "async", "overlap": False}, False),
    ({"mode": "async", "max_staleness": 2}, False),
    ({"mode": "async", "replication": "in_graph"}, False),
    ({"mode": "sync"}, False),
])
def test_the_default_is_on_where_async_allows_it(keys, expected):
    assert TrainingSpec(**keys).overlaps() is expected
    assert TrainingSpec(**keys).overlaps(tables=True) is (expected and "overlap" in keys)


def test_one_async_replica_is_plain_sgd_without_overlap_and_one_step_stale_by_default(inproc_client, tmp_path):
    """With ``overlap: false`` every push is computed on the last reply: the model equals one
    process's SGD. By default the replica's gradients are one step stale, so the same run differs
    (a default that silently stayed off, or an overlap that still waited, would make them equal)."""
    models = {}
    for name, value in {"off": False, "default": None}.items():
        spec = dtrain.loads(SPEC, base_dir=".")
        spec.training.overlap = value
        result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name)
        assert result.summary["status"] == "completed" and result.summary["global_step"] >= 30
        models[name] = result.model
    reference = single_process(dtrain.loads(SPEC, base_dir="."), 1)
    assert max_abs_diff(models["off"], reference) <= 1e-5
    assert max_abs_diff(models["default"], reference) > 1e-4
