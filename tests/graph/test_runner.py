"""Graph pipelines evaluated as a Dask graph on real workers (the op math: test_ops.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dtrain
from dtrain.errors import RunError
from dtrain.graph.initializers import initialize
from tests.helpers.paths import ROOT


def pipeline(name: str) -> Path:
    return ROOT / "pipelines" / name


def test_hello_graph(inproc_client, run_dir):
    """SEED-1: the guide's string constant comes back as written."""
    result = dtrain.run(dtrain.load(pipeline("hello_graph.yaml")), client=inproc_client, run_dir=run_dir)
    assert result.fetched == {"answer": "Hello distributed TensorFlow!"}
    assert result.summary["status"] == "completed"
    assert result.summary["placement"] == {"hello": "local-0", "answer": "local-0"}
    assert json.loads((run_dir / "summary.json").read_text())["fetched"] == {"answer": "Hello distributed TensorFlow!"}


def test_nested_scopes_graph_runs_where_tf_would(inproc_client, run_dir):
    """SEED-16: v1..v3 on ps tasks 0, 1, 0; s on worker 0; p1 and p2 (pinned /task:1, /task:1/cpu:0) on worker 1."""
    result = dtrain.run(dtrain.load(pipeline("nested_scopes_graph.yaml")), client=inproc_client, run_dir=run_dir)
    assert result.fetched == {"s": 3.0, "p1": 6.0, "p2": 9.0}
    assert result.summary["placement"] == {"v1": "ps-0", "v2": "ps-1", "s": "worker-0", "p1": "worker-1",
                                           "p2": "worker-1"}  # v3 is not needed by the fetches: not evaluated
    assert result.summary["devices"]["p2"] == "/job:worker/task:1/device:CPU:0"


def test_initialized_and_string_variables_run(inproc_client, run_dir):
    """SEED-18: tf.get_variable([2, 2], initializer=random_normal_initializer(seed=...)); the value is
    the seeded draw, the same on the worker as here. R10: without a ps job the variables stay on worker 0."""
    spec = dtrain.loads("""
name: init-graph
cluster: {jobs: {worker: 2}}
variables:
  - {name: w, shape: [2, 2], initializer: {type: random_normal, mean: 0, stddev: 1, seed: 42}}
  - {name: b, shape: [2], initializer: {type: ones}}
  - {name: greeting, value: "Hello "}
  - {name: who, value: "distributed TensorFlow!", device: /task:1}
graph:
  - {name: y, op: add, inputs: [w, b], device: /task:1}
  - {name: text, op: add, inputs: [greeting, who]}
fetch: [w, y, text]
""")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    w = initialize({"type": "random_normal", "mean": 0.0, "stddev": 1.0, "seed": 42}, [2, 2])
    assert result.fetched["w"] == w.tolist()
    assert result.fetched["y"] == (w + 1).tolist()
    assert result.fetched["text"] == "Hello distributed TensorFlow!"
    assert result.summary["placement"] == {"w": "worker-0", "b": "worker-0", "greeting": "worker-0",
                                           "who": "worker-1", "y": "worker-1", "text": "worker-0"}
    again = dtrain.run(spec, client=inproc_client, run_dir=run_dir / "again")
    assert again.fetched == result.fetched  # seeded: the same values every run


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


@pytest.mark.processes
def test_cli_prints_the_hello_string_as_written(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", str(pipeline("hello_graph.yaml")), "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answer = Hello distributed TensorFlow!" in proc.stdout.splitlines()
