"""Golden pipelines are tested data: every file in pipelines/ validates, compiles and runs (with few
steps, on the shared in-process cluster). Accuracy targets are checked by the tests of the
features they exercise (test_session, test_sync, test_cli)."""

from __future__ import annotations

import pytest

import dtrain
from dtrain.spec.pipeline import embedded_only_problems
from tests.helpers.paths import ROOT

PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


def test_there_are_pipelines_for_every_mode():
    specs = [dtrain.load(p) for p in PIPELINES]
    modes = {(s.training.mode, s.training.replication) for s in specs if not s.is_graph}
    assert {("async", "between_graph"), ("sync", "between_graph"), ("sync", "in_graph"),
            ("async", "in_graph")} <= modes
    assert any(s.is_graph for s in specs)


SCALE_1TB = 1000
"""dlrm_criteo_1tb.yaml runs here with each table 1/SCALE_1TB of its rows (the benchmark runs it whole)."""


def overrides_for(path) -> list[str]:
    """A few steps on the shared cluster; a recommendation pipeline's one pass over its sample data
    repeats (data.epochs off), and the 1TB one's tables shrink by SCALE_1TB."""
    out = ["training.steps=20", "summary.every_steps=10", "summary.tensorboard=false", "eval={}", "checkpoint=null"]
    spec = dtrain.load(path)
    if spec.model is not None and spec.model.tables:
        out.append("data.epochs=null")
        if path.stem == "dlrm_criteo_1tb":
            out += [f"model.tables.{name}.num_embeddings={max(1, t.num_embeddings // SCALE_1TB)}"
                    for name, t in spec.model.tables.items()]
    return out


# The two DLRM pipelines (large sparse tables, even shrunk) take 8-10 s each: the slow tier runs them.
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem.startswith("dlrm_") else [])
                                  for p in PIPELINES])
def test_pipeline_runs(path, inproc_client, tmp_path):
    spec = dtrain.load(path, overrides=overrides_for(path))
    plan = dtrain.compile(spec)
    # cluster.adaptive scales the embedded cluster, and a pipeline that sizes it (cluster.memory_limit,
    # ...) is refused on a cluster of one's own: those run on an in-process embedded cluster
    own = spec.cluster.adaptive is not None or bool(embedded_only_problems(spec, where="client="))
    client = None if own else inproc_client
    result = dtrain.run(spec, client=client, run_dir=tmp_path / "run", processes=False)
    if spec.is_graph:
        assert set(result.fetched) == set(spec.fetch)
        assert (tmp_path / "run" / "summary.json").is_file()
        return
    assert result.summary["status"] == "completed"
    assert result.summary["global_step"] >= 20
    assert result.summary["replicas"] == plan.num_replicas
    assert (tmp_path / "run" / "model.pt").is_file()
