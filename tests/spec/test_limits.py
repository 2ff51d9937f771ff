"""Values that used to pass validation and fail (or diverge) at run time (review M12, L6): every
float is finite, timeouts are at most a week, sizes are bounded, and YAML aliases cannot blow a
small file up. Each case goes through `dtrain validate`: exit 2, one line naming the field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import dtrain
from dtrain.cli import main
from dtrain.spec.base import MAX_STEPS
from dtrain.spec.errors import SpecError

MODEL = "model:\n  input_shape: [4]\n  layers:\n    - {type: linear, out: 3}\n"

# (the YAML after the model, the dotted path reported, a fragment of the message); from the review.
SNIPPETS = [
    ("training: {barrier_timeout_s: 1.0e+20}", "training.barrier_timeout_s", "must be <= 604800 (one week)"),
    ("training: {call_timeout_s: .inf}", "training.call_timeout_s", "expected a finite number, got inf"),
    ("training: {call_timeout_s: 1.0e+10}", "training.call_timeout_s", "must be <= 604800"),
    ("cluster: {wait_s: .inf}", "cluster.wait_s", "finite"),
    ("cluster: {worker_ttl_s: 1.0e+10}", "cluster.worker_ttl_s", "must be <= 604800"),
    ("cluster: {lease_s: 1.0e+10}", "cluster.lease_s", "must be <= 604800"),
    ("cluster: {lease_s: 0}", "cluster.lease_s", "must be > 0"),
    ("training: {bucket_mb: .inf}", "training.bucket_mb", "finite"),
    ("training: {bucket_mb: 1.0e+6}", "training.bucket_mb", "must be <= 1024"),
    ("optimizer: {name: sgd, lr: .inf}", "optimizer.lr", "expected a finite number, got inf"),
    ("optimizer: {name: sgd, lr: .nan}", "optimizer.lr", "expected a finite number, got nan"),
    ("optimizer: {name: momentum, weight_decay: .inf}", "optimizer.weight_decay", "finite"),
    ("optimizer: {name: adam, betas: [1.5, 0.9]}", "optimizer.betas[0]", "must be < 1, got 1.5"),
    ("optimizer: {name: adam, betas: [0.9, -3]}", "optimizer.betas[1]", "must be >= 0, got -3"),
    ("optimizer: {name: adam, eps: .inf}", "optimizer.eps", "finite"),
    ("optimizer: {name: adagrad, eps: .nan}", "optimizer.eps", "finite"),
    ("training: {seed: 100000000000000000000000}", "training.seed", "must be <= 4294967295"),
    ("training: {steps: 10000000000000000000}", "training.steps", "must be <= 4611686018427387904 (2**62)"),
    ("training: {steps: 1e12}", "training.steps", "write the integer out: 1000000000000"),
    ("checkpoint: {every_secs: .inf}", "checkpoint.every_secs", "finite"),
    ("hooks: [{type: logging, every_secs: 1.0e+9}]", "hooks[0].every_secs", "must be <= 604800"),
    ("cluster: {memory_limit: banana}", "cluster.memory_limit", "write a size such as 4GiB"),
    ("placement: {worker_device: /job:ps/task:0/device:TPU:0}", "placement.worker_device",
     "worker_device takes only the device part"),
    ("placement: {worker_device: /device:TPU:0}", "placement.worker_device", "device type 'TPU' does not exist"),
    ("cluster: {jobs: {ps: 1, worker: 100}}", "cluster.jobs", "at most 64 run on one machine"),
]


@pytest.mark.parametrize(("extra", "path", "fragment"), SNIPPETS, ids=[s[1] + ":" + s[0][:40] for s in SNIPPETS])
def test_validate_rejects_non_finite_huge_and_unknown_values(tmp_path, capsys, extra, path, fragment):
    f = tmp_path / "p.yaml"
    f.write_text(MODEL + extra + "\n")
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{f}:5: {path}: "), err
    assert fragment in err[0]


def test_the_bounds_still_accept_sane_values():
    spec = dtrain.loads(MODEL + """\
cluster: {jobs: {ps: 4, worker: 60}, wait_s: 604800, memory_limit: 512MiB}
training: {barrier_timeout_s: 3600, call_timeout_s: 0.5, seed: 4294967295, steps: 1.0e+12, bucket_mb: 1024}
optimizer: {name: adam, lr: 1e-3, betas: [0.0, 0.999999], eps: 1e-12}
""")
    assert spec.training.steps == 10**12 and spec.optimizer.lr == 0.001
    # A real scheduler serves the tasks: the embedded cap does not apply (--scheduler passes it in).
    big = MODEL + "cluster: {jobs: {ps: 2, worker: 100}}\n"
    assert dtrain.loads(big, scheduler="tcp://10.0.0.5:8786").cluster.num_tasks("worker") == 100
    assert dtrain.loads(big.replace("}}", "}, scheduler: tcp://10.0.0.5:8786}")).cluster.scheduler


def test_steps_are_bounded():
    with pytest.raises(SpecError, match="training.steps: must be <="):
        dtrain.loads(MODEL + f"training: {{steps: {MAX_STEPS + 1}}}\n")
    assert dtrain.loads(MODEL + f"training: {{steps: {MAX_STEPS}}}\n").training.steps == MAX_STEPS


# ------------------------------------------------------------------------------------ YAML aliases


def _bomb(levels: int) -> str:
    lines = ["    a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "model:\n  module: tests.helpers.models:TinyMLP\n  kwargs:\n" + "\n".join(lines) + "\n"


def test_ten_level_alias_bomb_is_refused_fast(tmp_path: Path, capsys):
    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb(10))  # 9**10 expanded: tens of GB of JSON in pipeline_hash, before the fix
    t0 = time.perf_counter()
    assert main(["validate", str(f)]) == 2
    assert time.perf_counter() - t0 < 10  # expanded, it would take minutes and tens of GB
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{f}:13: YAML aliases expand this file to "), err


def test_ordinary_anchors_and_merge_keys_still_work():
    spec = dtrain.loads("""\
model:
  input_shape: [4]
  layers:
    - &hidden {type: linear, out: 8}
    - {type: relu}
    - *hidden
    - {<<: *hidden, out: 3}
hooks:
  - &every10 {type: logging, every_steps: 10}
  - {<<: *every10, type: step_counter}
""")
    assert [getattr(layer, "out", None) for layer in spec.model.layers] == [8, None, 8, 3]
    assert [h.type for h in spec.hooks] == ["logging", "step_counter"]
    assert len(spec.pipeline_hash()) == 64


def test_recursive_alias_and_deep_nesting_are_spec_errors():
    with pytest.raises(SpecError, match=r"<string>:3: .*recursive alias"):
        dtrain.loads("model:\n  module: tests.helpers.models:TinyMLP\n  kwargs: &k {again: *k}\n")
    with pytest.raises(SpecError, match=r"<string>:1: YAML nests too deeply"):
        dtrain.loads("model: " + "[" * 5000 + "]" * 5000)


def test_an_input_shape_past_int64_is_one_line_naming_the_field(tmp_path, capsys):
    """An ``input_shape`` entry past int64 reached torch, whose message carries a 40-line C++
    backtrace, and exit 2 printed all of it: a dimension is now bounded in the spec (no example
    has 2**31 values along one axis) and a layer's build error is one line."""
    f = tmp_path / "p.yaml"
    f.write_text("model:\n  input_shape: [99999999999999999999]\n  layers:\n    - {type: linear, out: 3}\n")
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{f}:2: model.input_shape[0]: "), err
    assert "must be <= 2147483647" in err[0]


def test_a_layer_size_past_int64_is_one_line(tmp_path, capsys):
    """The same C++ backtrace came from any layer torch cannot build (here a linear layer's
    ``out`` past int64): only the message's first line is kept."""
    f = tmp_path / "p.yaml"
    f.write_text("model:\n  input_shape: [4]\n  layers:\n    - {type: linear, out: 99999999999999999999}\n")
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{f}:4: model.layers[0]: layer 0 (linear): "), err
