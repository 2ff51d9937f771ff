"""The graph section's rules (spec/graph.py): values, strings, initializers and device scopes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dtrain
from dtrain.spec.errors import SpecError
from tests.helpers.paths import ROOT


def problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        dtrain.loads(text)
    return [(p.path, p.message) for p in info.value.problems]


GRAPH = """
cluster: {jobs: {ps: 2, worker: 2}}
variables:
%s
graph:
%s
"""


def test_string_constants_are_values():
    spec = dtrain.loads(GRAPH % ('  - {name: hello, value: "Hello distributed TensorFlow!"}',
                                 "  - {name: twice, op: add, inputs: [hello, hello]}\n"
                                 "  - {name: same, op: identity, inputs: [twice]}"))
    assert spec.variables[0].value == "Hello distributed TensorFlow!"


@pytest.mark.parametrize("op, inputs, path, message", [
    ("mul", "[s, 2]", "graph[0].op", "mul takes numbers, but 's' is a string; strings take identity and add "
                                     "(which concatenates)"),
    ("add", "[s, 2]", "graph[0].inputs", "add mixes the string 's' with a number; add concatenates two strings "
                                         "(TF refuses string + number too)"),
    ("add", "[x, s]", "graph[0].inputs", "add mixes the string 's' with a number; add concatenates two strings "
                                         "(TF refuses string + number too)"),
    ("sqrt", "[s]", "graph[0].op", "sqrt takes numbers, but 's' is a string; strings take identity and add "
                                   "(which concatenates)"),
])
def test_numeric_ops_refuse_strings(op, inputs, path, message):
    found = problems(GRAPH % ('  - {name: s, value: "a"}\n  - {name: x, value: 1.0}',
                              f"  - {{name: y, op: {op}, inputs: {inputs}}}"))
    assert found == [(path, message)]


def test_a_string_op_result_is_a_string():
    found = problems(GRAPH % ('  - {name: s, value: "a"}', "  - {name: t, op: identity, inputs: [s]}\n"
                              "  - {name: u, op: neg, inputs: [t]}"))
    assert found == [("graph[1].op", "neg takes numbers, but 't' is a string; strings take identity and add "
                                     "(which concatenates)")]


@pytest.mark.parametrize("var, path, fragment", [
    ("{name: w, value: 1.0, initializer: {type: zeros}, shape: [2]}", "variables[0]",
     "give exactly one of value (e.g. value: 1.0) and initializer"),
    ("{name: w}", "variables[0]", "give exactly one of value"),
    ("{name: w, initializer: {type: ones}}", "variables[0]", "an initializer needs the variable's shape"),
    ("{name: w, value: 1.0, shape: [2]}", "variables[0]", "shape goes with initializer"),
    ("{name: w, initializer: {type: zeros, stddev: 2.0}, shape: [2]}", "variables[0].initializer",
     "stddev does not apply to a zeros initializer (it takes seed): remove it"),
    ("{name: w, initializer: {type: random_uniform, mean: 2.0}, shape: [2]}", "variables[0].initializer",
     "mean does not apply to a random_uniform initializer (it takes maxval, minval, seed)"),
    ("{name: w, initializer: {type: random_uniform, minval: 1, maxval: 1}, shape: [2]}",
     "variables[0].initializer", "random_uniform needs minval < maxval, got 1.0 and 1.0"),
    ("{name: w, initializer: {type: random_normal, stddev: 0}, shape: [2]}", "variables[0].initializer.stddev",
     "must be > 0"),
    ("{name: w, initializer: {type: glorot}, shape: [2]}", "variables[0].initializer.type", "'glorot'"),
    ("{name: w, initializer: {type: zeros}, shape: [4096, 8192]}", "variables[0]",
     "has 33554432 elements; at most 16777216"),
    ("{name: w, initializer: {type: zeros}, shape: [0]}", "variables[0].shape[0]", "must be >= 1"),
])
def test_initializer_rules(var, path, fragment):
    found = problems(GRAPH % (f"  - {var}", "  - {name: y, op: identity, inputs: [w]}"))
    assert [p for p, _ in found] == [path] and fragment in found[0][1], found


def test_initializer_takes_tf1_defaults():
    spec = dtrain.loads(GRAPH % ("  - {name: w, shape: [], initializer: {type: truncated_normal}}",
                                 "  - {name: y, op: identity, inputs: [w]}"))
    init = spec.variables[0].initializer
    assert (init.mean, init.stddev, init.minval, init.maxval, init.seed) == (0.0, 1.0, 0.0, 1.0, None)
    assert spec.variables[0].shape == []


# ----------------------------------------------------------------------------------- devices


def test_relative_pins_are_checked_against_the_enclosing_job():
    found = problems(GRAPH % ("  - {name: v, value: 1.0, device: /task:2}",
                              "  - {name: y, op: identity, inputs: [v], device: /task:2/cpu:0}"))
    assert found == [
        ("variables[0].device", "'/task:2' names task 2 but job 'ps' has 2 task(s) (0..1) (a pin without a job is "
                                "in the enclosing scope's job, 'ps'); add tasks in cluster.jobs or pick an existing one"),
        ("graph[0].device", "'/task:2/cpu:0' names task 2 but job 'worker' has 2 task(s) (0..1) (a pin without a job "
                            "is in the enclosing scope's job, 'worker'); add tasks in cluster.jobs or pick an "
                            "existing one")]
    # No ps job (replica_device_setter with ps_tasks=0): a variable's scope is the default op device's job.
    found = problems("cluster: {jobs: {local: 1}}\nvariables: [{name: v, value: 1.0, device: /task:1}]\n")
    assert found[0][0] == "variables[0].device" and "job 'local' has 1 task(s)" in found[0][1]


def test_none_clears_scopes_of_graph_nodes_only():
    spec = dtrain.loads(GRAPH % ("  - {name: v, value: 1.0, device: none}",
                                 "  - {name: y, op: identity, inputs: [v], device: None}"))
    assert (spec.variables[0].device, spec.graph[0].device) == ("none", "None")
    found = problems("model: {input_shape: [4], layers: [{type: linear, out: 3}]}\n"
                     "placement: {variable_devices: {'0.weight': none}}\n")
    assert found[0][0] == "placement.variable_devices.0.weight" and "applies to graph variables and ops only" \
        in found[0][1]


@pytest.mark.parametrize("name", ["123", "my-job", "ps.v2", "_ps"])
def test_cluster_job_names_follow_tensorflows_rule(name):
    found = problems(f"cluster: {{jobs: {{'{name}': 1, worker: 1}}}}\nvariables: [{{name: v, value: 1.0}}]\n")
    assert found == [(f"cluster.jobs.{name}", f"job name {name!r} must match [a-zA-Z][_a-zA-Z0-9]* (a letter, "
                                              "then letters, digits or '_'), as TensorFlow's servers require")]


def test_usual_job_names_stay_valid():
    spec = dtrain.loads("cluster: {jobs: {ps: 1, worker: 1, local: 1, moon: 1, sun_2: 1}}\n"
                        "variables: [{name: v, value: 1.0, device: /job:sun_2/task:0}]\n")
    assert list(spec.cluster.jobs) == ["ps", "worker", "local", "moon", "sun_2"]


def test_worker_cli_refuses_a_job_name_a_device_string_could_not_name():
    proc = subprocess.run([sys.executable, "-m", "dtrain.cli", "worker", "--job", "ps-1", "--task", "0",
                           "--scheduler", "tcp://127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--job 'ps-1': a job name must match [a-zA-Z][_a-zA-Z0-9]*" in proc.stderr
