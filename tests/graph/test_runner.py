"""Graph pipelines evaluated as a Dask graph on real workers (the op math: test_ops.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dtrain
from dtrain.spec.errors import RunError
from tests.helpers.paths import ROOT


def pipeline(name: str) -> Path:
    return ROOT / "pipelines" / name


def test_hello_graph(inproc_client, run_dir):
    result = dtrain.run(dtrain.load(pipeline("hello_graph.yaml")), client=inproc_client, run_dir=run_dir)
    assert result.fetched == {"answer": 42.0}
    assert result.summary["status"] == "completed"
    assert result.summary["placement"] == {"hello": "local-0", "answer": "local-0"}


def test_pinning_graph_runs_where_pinned(inproc_client, run_dir):
    result = dtrain.run(dtrain.load(pipeline("pinning_graph.yaml")), client=inproc_client, run_dir=run_dir)
    assert result.fetched == {"c": 4.0}
    assert isinstance(result.fetched["c"], float)
    s = result.summary
    assert (s["name"], s["status"], s["fetched"]) == ("pinning-graph", "completed", {"c": 4.0})
    assert s["placement"] == {"a": "ps-0", "b": "worker-0", "c": "worker-1"}
    assert [o.name for o in result.plan.ops] == ["a", "b", "c"]
    assert all(o.address for o in result.plan.ops)


def test_matmul_graph_with_nested_lists(inproc_client, run_dir):
    spec = dtrain.loads("""
name: matmul-graph
cluster: {jobs: {ps: 2, worker: 2}}
variables:
  - {name: w, value: [[1.0, 2.0], [3.0, 4.0]], device: /job:ps/task:1}
  - {name: x, value: [[1.0], [1.0]]}
graph:
  - {name: y, op: matmul, inputs: [w, x], device: /job:worker/task:1}
  - {name: z, op: relu, inputs: [y]}
  - {name: total, op: sum, inputs: [z], device: /job:worker/task:0}
  - {name: unused, op: neg, inputs: [x]}
fetch: [y, total]
""")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.fetched == {"y": [[3.0], [7.0]], "total": 10.0}
    # Only what the fetches need is evaluated, like TF's Session.run.
    # x has no device: the compiler's round robin places it; it ran where the plan said.
    x_worker = next(o.worker for o in result.plan.ops if o.name == "x")
    assert result.summary["placement"] == {"w": "ps-1", "x": x_worker, "y": "worker-1", "z": "worker-0",
                                           "total": "worker-0"}


def test_op_error_is_a_run_error_naming_the_op(inproc_client, run_dir):
    spec = dtrain.loads("""
name: bad-graph
cluster: {jobs: {ps: 1, worker: 1}}
variables:
  - {name: a, value: [[1.0, 2.0, 3.0]]}
  - {name: b, value: [[1.0, 2.0]]}
graph:
  - {name: bad, op: matmul, inputs: [a, b]}
  - {name: after, op: neg, inputs: [bad]}
fetch: [after]
""")
    with pytest.raises(RunError, match=r"matmul 'bad' failed on worker-0.*\(1, 3\) and \(1, 2\) are not aligned"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)


@pytest.mark.processes
def test_cli_runs_pinning_graph_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", str(pipeline("pinning_graph.yaml")),
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "c = 4.0" in proc.stdout.splitlines()
