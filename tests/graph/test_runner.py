"""Graph pipelines: the op math (pure torch) and evaluation as a Dask graph on real workers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.graph.runner import OPS, apply_op, to_python
from dtrain.spec.errors import RunError
from dtrain.spec.pipeline import GRAPH_OPS
from tests.helpers.paths import ROOT


def pipeline(name: str) -> Path:
    return ROOT / "pipelines" / name


# ------------------------------------------------------------------------------------ op math

CASES = [
    ("add", [1.0, 2.0], 3.0),
    ("add", [[1.0, 2.0], 10.0], [11.0, 12.0]),
    ("sub", [5.0, 7.0], -2.0),
    ("mul", [[1.0, 2.0], [3.0, 4.0]], [3.0, 8.0]),
    ("div", [1.0, 4.0], 0.25),
    ("matmul", [[[1.0, 2.0]], [[3.0], [4.0]]], [[11.0]]),
    ("matmul", [[[1.0, 0.0], [0.0, 2.0]], [5.0, 6.0]], [5.0, 12.0]),
    ("neg", [3.0], -3.0),
    ("identity", [[1.0, 2.0]], [1.0, 2.0]),
    ("sum", [[[1.0, 2.0], [3.0, 4.0]]], 10.0),
    ("mean", [[1.0, 2.0, 3.0, 6.0]], 3.0),
    ("square", [-3.0], 9.0),
    ("sqrt", [[4.0, 9.0]], [2.0, 3.0]),
    ("relu", [[-1.0, 0.0, 2.0]], [0.0, 0.0, 2.0]),
    ("exp", [0.0], 1.0),
    ("maximum", [[1.0, 5.0], [3.0, 2.0]], [3.0, 5.0]),
    ("minimum", [[1.0, 5.0], 3.0], [1.0, 3.0]),
    ("pow", [2.0, 10.0], 1024.0),
]


@pytest.mark.parametrize(("op", "inputs", "expected"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_op_values(op, inputs, expected):
    out = apply_op(op, inputs)
    assert out.dtype == torch.float32
    got = to_python(out)
    if isinstance(expected, list) and expected and isinstance(expected[0], list):
        assert got == expected  # exact in float32; approx() does not nest
    else:
        assert got == pytest.approx(expected)


def test_every_graph_op_has_a_function_and_a_case():
    assert set(OPS) == set(GRAPH_OPS)
    assert {c[0] for c in CASES} == set(GRAPH_OPS)


@pytest.mark.parametrize(("op", "inputs", "match"), [
    ("matmul", [[[1.0, 2.0, 3.0]], [[1.0], [2.0]]], r"matmul: shapes \(1, 3\) and \(2, 1\) are not aligned"),
    ("matmul", [2.0, [1.0]], r"matmul needs inputs of rank >= 1"),
    ("add", [[1.0, 2.0], [1.0, 2.0, 3.0]], r"add: shapes \(2,\) and \(3,\) do not broadcast"),
    ("neg", [1.0, 2.0], r"neg takes 1 input"),
    ("add", [[[1.0], [1.0, 2.0]], 1.0], r"rectangular"),
    ("nope", [1.0], r"unknown op 'nope'"),
])
def test_op_errors(op, inputs, match):
    with pytest.raises(ValueError, match=match):
        apply_op(op, inputs)


def test_sqrt_of_negative_is_nan_like_tf():
    assert math.isnan(to_python(apply_op("sqrt", [-1.0])))


# ------------------------------------------------------------------------- on the Dask cluster


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
