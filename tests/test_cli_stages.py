"""Pipeline stages through the CLI: `dtrain plan` shows the stages, and a model that cannot be
split, or pins that cannot be run, exit 2 with FILE:LINE: key: message, starting nothing."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import dtrain_cli as dtrain

pytestmark = pytest.mark.slow  # a `dtrain` process per command

MODULE_PIPELINE = """name: staged-module
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  module: {module}
  input_shape: [64]
  loss: {loss}
placement:
  layer_devices: {pins}
data: {{source: sklearn:digits, batch_size: 16}}
"""


def write(tmp_path, module: str, pins: str, loss: str = "cross_entropy"):
    path = tmp_path / "p.yaml"
    path.write_text(MODULE_PIPELINE.format(module=module, pins=pins, loss=loss))
    return path


def test_plan_shows_the_stages_of_a_module(tmp_path):
    path = write(tmp_path, "tests.helpers.models:StageRecorder",
                 "{encoder: /job:worker/task:0, act: /job:worker/task:0, head: /job:worker/task:1}")
    path.write_text(path.read_text().replace("module: tests", f"kwargs: {{record_dir: {str(tmp_path)!r}}}\n  module: tests"))
    out = dtrain("plan", str(path), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(s["position"], s["layers"], s["param_bytes"]) for s in doc["stages"]] == [
        (0, ["encoder", "act"], 4 * (64 * 32 + 32)), (1, ["head"], 4 * (32 * 10 + 10))]
    assert doc["stages"][0]["activation_bytes"] == 16 * 32 * 4  # one micro-batch (the whole batch) of 32 floats
    assert doc["replicas"][0]["stage_tasks"] == ["/job:worker/task:0", "/job:worker/task:1"]
    text = dtrain("plan", str(path)).stdout
    assert "stages: 2 on 2 task(s) per replica, 1 pipeline replica(s)" in text


@pytest.mark.parametrize(("module", "pins", "loss", "key", "words"), [
    ("tests.helpers.models:Residual", "{fc1: /job:worker/task:0, act: /job:worker/task:0, fc2: /job:worker/task:1}",
     "cross_entropy", "placement.layer_devices", "cannot be split into pipeline stages: its children run one after the other"),
    ("tests.helpers.models:Branches", "{left: /job:worker/task:0, right: /job:worker/task:1}", "cross_entropy",
     "placement.layer_devices", "child 'right' failed on the previous child's output"),
    ("tests.helpers.models:StageRecorder", "{encoder: /job:worker/task:0, tail: /job:worker/task:1}", "cross_entropy",
     "placement.layer_devices.tail", "names no top-level child"),
    ("tests.helpers.models:StageRecorder", "{encoder: /job:worker/task:1}", "cross_entropy",
     "placement.layer_devices", "after layers on stage task 1"),
])
def test_a_module_that_cannot_be_staged_exits_2(tmp_path, module, pins, loss, key, words):
    path = write(tmp_path, module, pins, loss)
    if "StageRecorder" in module:
        path.write_text(path.read_text().replace("module: tests", f"kwargs: {{record_dir: {str(tmp_path)!r}}}\n  module: tests"))
    out = dtrain("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    assert f"{path}:" in out.stderr and f" {key}: " in out.stderr and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_bad_layer_pins_exit_2_naming_the_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("""name: bad-stages
cluster: {jobs: {ps: 1, worker: 3}}
model:
  input_shape: [64]
  layers:
    - {type: linear, out: 16, device: /job:worker/task:0}
    - {type: linear, out: 10, device: /job:worker/task:1}
""")
    out = dtrain("validate", str(path))
    assert out.returncode == 2
    assert f"{path}:2: cluster.jobs.worker: 3 worker task(s) for a pipeline of 2 stage tasks" in out.stderr
