"""Graph pipelines' op math (pure torch): values, errors, and TF's behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.graph.ops import OPS, apply_op, to_python
from dtrain.spec.graph import GRAPH_OPS

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


def test_strings_pass_through_identity_and_add_concatenates():
    assert apply_op("identity", ["Hello distributed TensorFlow!"]) == "Hello distributed TensorFlow!"
    assert apply_op("add", ["Hello ", "distributed TensorFlow!"]) == "Hello distributed TensorFlow!"
    assert to_python("b'not bytes'") == "b'not bytes'"  # a string is printed as written


@pytest.mark.parametrize(("op", "inputs"), [("mul", ["a", 2.0]), ("add", ["a", 1.0]), ("neg", ["a"])])
def test_numeric_ops_refuse_strings(op, inputs):
    with pytest.raises(ValueError, match=f"{op} takes numbers, got a string"):
        apply_op(op, inputs)
