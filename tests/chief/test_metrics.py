"""The metric sinks: TensorBoard groups the telemetry per replica and per shard; user-defined
summaries (``StepContext.summary``: TF's tf.summary.scalar from a hook) and step_counter's
``global_step/sec`` land in metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dtrain
from dtrain.chief.hooks import StepContext
from dtrain.chief.metrics import TensorBoardSink, check_summary
from dtrain.chief.report import read_metrics
from dtrain.errors import RunError
from tests.helpers.pipelines import pipeline_yaml


def test_tensorboard_groups_telemetry_per_replica_and_per_shard(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log({"loss": 0.5, "replicas": 2, "eval": {"accuracy": 0.9},
              "replica_stats": {"0": {"task": "/job:worker/task:0", "steps_per_s": 410.0, "data_frac": 0.1},
                                "1": {"steps_per_s": 12.5}},
              "shard_stats": {"1": {"busy_frac": 0.93, "variables": ["0.weight"], "staleness": {"mean": 1.0}}}}, 100)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "replicas", "eval/accuracy", "replica_0/steps_per_s", "replica_0/data_frac",
            "replica_1/steps_per_s", "shard_1/busy_frac"} == tags
    assert acc.Scalars("replica_1/steps_per_s")[0].value == 12.5 and acc.Scalars("shard_1/busy_frac")[0].step == 100


# ------------------------------------------------------------------------ user-defined summaries


@pytest.mark.parametrize(("tag", "value", "step", "message"), [
    (3, 1.0, 0, "summary tag must be a non-empty string such as 'my/accuracy', got 3"),
    ("", 1.0, 0, "summary tag must be a non-empty string"),
    ("  ", 1.0, 0, "summary tag must be a non-empty string"),
    ("loss", 1.0, 0, "summary tag 'loss' is one of dtrain's own metrics"),
    ("eval/accuracy", 1.0, 0, "choose another name, e.g. 'my/accuracy'"),
    ("my/x", float("nan"), 0, "summary 'my/x': the value must be a finite number (int or float), got nan"),
    ("my/x", float("inf"), 0, "got inf"),
    ("my/x", "0.5", 0, "got '0.5'"),
    ("my/x", True, 0, "got True"),
    ("my/x", torch.ones(2), 0, "the value must be a finite number"),
    ("my/x", 1.0, -1, "summary 'my/x': step must be a global step (an int >= 0) or None, got -1"),
    ("my/x", 1.0, 2.5, "got 2.5"),
])
def test_a_bad_summary_is_refused_naming_the_argument(tag, value, step, message):
    with pytest.raises(ValueError) as info:
        check_summary(tag, value, step)
    assert message in str(info.value)


def test_summaries_take_numbers_tensors_and_numpy_scalars():
    assert check_summary("my/x", 3, 7) == ("my/x", 3.0, 7)
    assert check_summary("my/x", torch.tensor(0.25), np.int64(2)) == ("my/x", 0.25, 2)
    assert check_summary("my/x", np.float32(1.5), 0) == ("my/x", 1.5, 0)
    ctx = StepContext(12)  # outside a run: collected, written nowhere
    ctx.summary("my/x", 1)
    ctx.summary("my/y", 2.0, step=10)
    assert ctx.summaries == [("my/x", 1.0, 12), ("my/y", 2.0, 10)]


SUMMARY_RUN = pipeline_yaml("summaries", jobs={"ps": 1, "worker": 2}, mode="sync", steps=40,
                            summary={"every_steps": 10, "tensorboard": True})


def test_a_custom_hook_writes_its_own_summaries_to_metrics_jsonl_and_tensorboard(inproc_client, run_dir):
    spec = dtrain.loads(SUMMARY_RUN + """hooks:
  - {type: "tests.helpers.hooks:SummaryHook"}
  - {type: step_counter, every_steps: 10}
""", base_dir=".")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    half = [r for r in records if "custom/half_step" in r]
    assert half and all(r["custom/half_step"] == r["step"] / 2 and set(r) == {"step", "time", "custom/half_step"}
                        for r in half)
    doubled = [r for r in records if "custom/loss_x2" in r]
    losses = {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
    assert doubled and all(r["step"] >= min(losses) for r in doubled)
    rates = [r for r in records if "global_step/sec" in r]  # TF's StepCounterHook summary
    assert rates and all(r["global_step/sec"] > 0 and r["step"] >= 10 for r in rates)
    # dtrain report still reads its own training records only.
    train, _evals, bad = read_metrics(run_dir / "metrics.jsonl")
    assert bad == 0 and sorted(train) == [10, 20, 30, 40] and all("loss" in r for r in train.values())

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert {"custom/half_step", "custom/loss_x2", "global_step/sec", "loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("custom/half_step")] == \
        [(r["step"], r["custom/half_step"]) for r in half]
    assert [e.step for e in acc.Scalars("global_step/sec")] == [r["step"] for r in rates]
    assert all(math.isfinite(e.value) and e.value > 0 for e in acc.Scalars("custom/loss_x2"))


def test_a_hook_writing_a_non_finite_summary_fails_the_run_with_the_reason(inproc_client, run_dir):
    spec = dtrain.loads(SUMMARY_RUN + """hooks: [{type: "tests.helpers.hooks:SummaryHook", args: {bad: .nan}}]
""", base_dir=".")
    with pytest.raises(RunError, match="summary 'custom/bad': the value must be a finite number"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert not any("custom/bad" in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
