"""Hooks with TensorFlow's meanings (stop_at_step, logging, step_counter, nan_guard, custom hooks by
import path) and the summary hook's TensorBoard events, read back with TensorBoard's own reader.
Runs use the shared in-process cluster and a tiny digits model."""

from __future__ import annotations

import json
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.chief.hooks import LoggingHook, StepContext, StepCounterHook, StopAtStepHook, build_hooks
from dtrain.errors import RunError
from dtrain.spec.errors import SpecError
from dtrain.spec.session import HookSpec
from tests.helpers import hooks as helper_hooks
from tests.helpers.pipelines import pipeline_yaml

BASE = pipeline_yaml("hooks", summary=None)


def nan_pipeline(name: str, after: int, keep: int, hooks: list) -> str:
    """A sync run whose gradients turn NaN after step ``after``; checkpoints every 15 steps."""
    return pipeline_yaml(name, model={"module": "tests.helpers.hooks:NanAfter", "kwargs": {"after": after}},
                         optimizer={"name": "sgd", "lr": 0.05}, mode="sync", steps=1000,
                         summary={"every_steps": 5, "tensorboard": False}, checkpoint={"every_steps": 15, "keep": keep},
                         hooks=hooks)


def spec(text: str) -> dtrain.PipelineSpec:
    return dtrain.loads(BASE + text, base_dir=".")


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ stop_at_step


def test_stop_at_last_step_stops_early(inproc_client, run_dir):
    s = spec("""
training: {mode: async, steps: 20000}
summary: {every_steps: 10, tensorboard: false}
hooks: [{type: stop_at_step, last_step: 30}]
""")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed"
    # The stop step reaches the ps like training.steps: exactly there, however fast the steps are.
    assert summary["global_step"] == 30
    assert (run_dir / "model.pt").is_file()


def test_stop_after_num_steps_with_logging_and_step_counter(inproc_client, run_dir, caplog):
    s = spec("""
training: {mode: sync, steps: 20000}
summary: {every_steps: 10, tensorboard: false}
hooks:
  - {type: stop_at_step, num_steps: 40}
  - {type: logging, every_steps: 10}
  - {type: step_counter, every_steps: 10}
""")
    with caplog.at_level(logging.INFO, logger="dtrain"):
        summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed"
    assert summary["global_step"] == 40
    mine = [r.getMessage() for r in caplog.records if r.name == "dtrain"]
    lines = [m for m in mine if m.startswith("step ")]
    assert lines, mine
    assert any("loss " in m and "samples/s " in m for m in lines), lines
    rates = [m for m in mine if m.startswith("global_step/sec: ")]
    assert rates and all(float(m.split()[-1]) > 0 for m in rates)
    assert any("stop_at_step" in r.getMessage() for r in caplog.records)  # the session says why it stopped


def test_stop_at_step_counts_num_steps_from_the_resumed_step():
    hook = StopAtStepHook(num_steps=10)
    hook.begin(SimpleNamespace(start_step=100))
    ctx = StepContext(109)
    hook.after_step(ctx)
    assert ctx.stop_requested is None
    ctx = StepContext(110)
    hook.after_step(ctx)
    assert ctx.stop_requested == "stop_at_step: reached step 110"


def test_step_counter_and_logging_start_counting_at_the_resumed_step(caplog):
    counter, log = StepCounterHook(every_steps=10), LoggingHook(every_steps=100)
    for h in (counter, log):
        h.begin(SimpleNamespace(start_step=1000))
    with caplog.at_level(logging.INFO, logger="dtrain"):
        for step in (1005, 1050, 1104, 1105):
            for h in (counter, log):
                h.after_step(StepContext(step, {"loss": 0.5}))
    assert len(counter.rates) == 2  # at 1050 and 1104; not at 1005 (5 steps since the resume, not 1005)
    # TF's LoggingTensorHook: the first step seen, then N steps after the last line.
    assert [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")] == \
        ["1005", "1105"]


# ------------------------------------------------------------------------------ nan_guard


@pytest.mark.parametrize("after", [40, 45])
def test_nan_guard_fails_the_run_and_keeps_a_finite_checkpoint(inproc_client, run_dir, after):
    # Checkpoints every 15 steps, exactly (the shards pause at each multiple until the chief has
    # its snapshot). after=45: the NaN gradients are computed on step 45's parameters while the
    # shards are held there for the checkpoint, and arrive as the chief writes it.
    s = dtrain.loads(nan_pipeline("nan", after, keep=5, hooks=[{"type": "nan_guard"}]), base_dir=".")
    with pytest.raises(RunError, match="nan_guard") as info:
        dtrain.run(s, client=inproc_client, run_dir=run_dir)
    assert "non-finite" in str(info.value)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "nan_guard" in summary["error"]
    # Both replicas' forward after `after` good ones is NaN: the ps refused that update.
    assert summary["global_step"] == after
    expected = [f"ckpt-{s:08d}" for s in range(0, after + 1, 15)]  # (step 0: the saver's at creation)
    assert summary["checkpoints"] == expected
    last = ckpt.latest(run_dir)
    assert last is not None and last.path.name == expected[-1]
    assert all(torch.isfinite(sh["params"]).all() for sh in last.payload["shards"])
    # metrics.jsonl holds no NaN (non-finite values are written as null, never as bare NaN).
    for rec in metrics(run_dir):
        assert rec.get("loss") is None or math.isfinite(rec["loss"])


# ------------------------------------------------------------------------------ custom hooks + TensorBoard


def test_custom_hook_callbacks_in_order_and_tensorboard_events(inproc_client, run_dir, tmp_path):
    calls_file = tmp_path / "calls.jsonl"
    helper_hooks.CALLS.clear()
    s = spec(f"""
training: {{mode: sync, steps: 40}}
summary: {{every_steps: 10, tensorboard: true}}
checkpoint: {{every_steps: 20, keep: 3}}
eval: {{every_steps: 20}}
hooks: [{{type: "tests.helpers.hooks:RecordingHook", args: {{path: "{calls_file}", tag: t1}}}}]
""")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and summary["global_step"] == 40
    assert summary["recoveries"] == 0, summary["recovery_log"]
    calls = helper_hooks.read_calls(calls_file)
    events = [c[0] for c in calls]
    assert events[0] == "begin" and calls[0][1] == 0
    assert events[-1] == "end" and calls[-1][1] == 40
    assert events.count("begin") == 1 and events.count("end") == 1
    # Every after_step follows a before_step of the same step; steps never go back.
    steps = [v for e, v in calls if e == "after_step"]
    assert steps and steps == sorted(steps) and steps[-1] <= 40
    for i, (e, v) in enumerate(calls):
        if e == "after_step":
            assert calls[i - 1] == ("before_step", v)
    ckpts = [v for e, v in calls if e == "on_checkpoint"]
    assert [c[0] for c in ckpts] == [int(n[5:13]) for n in summary["checkpoints"]]
    assert ckpts[-1][0] == 40 and ckpts[-1][1].endswith("ckpt-00000040")
    assert all(0 < i < len(events) - 1 for i, e in enumerate(events) if e == "on_checkpoint")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "samples_per_sec", "learning_rate", "eval/accuracy", "eval/loss"} <= tags, tags
    assert [e.step for e in acc.Scalars("loss")] == [10, 20, 30, 40]
    assert all(math.isfinite(e.value) and e.value > 0 for e in acc.Scalars("loss"))
    assert acc.Scalars("learning_rate")[0].value == pytest.approx(0.1)
    assert acc.Scalars("eval/accuracy")[-1].step == 40


def test_invalid_custom_hook_fails_clearly_before_anything_is_written(inproc_client, run_dir):
    s = spec("""
training: {steps: 20}
hooks: [{type: "tests.helpers.hooks:NotAHook"}]
""")
    with pytest.raises(SpecError, match=r"hooks\[0\]\.type: .*NotAHook.* not a subclass of dtrain\.Hook"):
        dtrain.run(s, client=inproc_client, run_dir=run_dir)
    assert not run_dir.exists()


@pytest.mark.parametrize(("hook", "message"), [
    ({"type": "tests.helpers.hooks:NotAHook"}, r"hooks\[1\]\.type: .*is a class NotAHook, not a subclass"),
    ({"type": "tests.helpers.hooks:CALLS"}, r"hooks\[1\]\.type: .*is a list, not a subclass"),
    ({"type": "tests.helpers.no_such_module:Hook"}, r"hooks\[1\]\.type: .*cannot be imported"),
    ({"type": "tests.helpers.hooks:Missing"}, r"hooks\[1\]\.type: .*has no attribute 'Missing'"),
    ({"type": "tests.helpers.hooks:RecordingHook", "args": {"paht": "x"}}, r"hooks\[1\]\.args: .*paht"),
])
def test_build_hooks_errors_name_the_hook(hook, message):
    specs = [HookSpec(type="nan_guard"), HookSpec.model_validate(hook)]
    with pytest.raises(SpecError, match=message):
        build_hooks(specs)


# ------------------------------------------------------------------------------ TF's hook semantics


@pytest.mark.parametrize("error", ["stop_iteration", "out_of_range"])
def test_a_hook_raising_stop_iteration_or_out_of_range_ends_the_run_cleanly(inproc_client, run_dir, tmp_path, error):
    # MS5: no exception escapes; should_stop is true; the end of a run is written as after a stop.
    s = spec(f"""
training: {{mode: sync, steps: 2000}}
summary: {{every_steps: 5, tensorboard: false}}
checkpoint: {{every_steps: 1000}}
hooks: [{{type: "tests.helpers.errors:RaiseAt", args: {{step: 20, error: {error}, path: "{tmp_path}/seen.jsonl"}}}}]
""")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and "error" not in summary
    name = {"stop_iteration": "StopIteration", "out_of_range": "OutOfRange"}[error]
    assert summary["stop_reason"] == f"{name} from a hook: raised by RaiseAt at step {seen_raised(tmp_path)}"
    assert 20 <= summary["global_step"] < 2000 and summary["recoveries"] == 0
    # The final checkpoint (at the stop step), the final evaluation and model.pt are written.
    assert summary["checkpoints"][-1] == f"ckpt-{summary['global_step']:08d}"
    assert summary["eval"]["accuracy"] > 0.3 and (run_dir / "model.pt").is_file()


def seen_raised(tmp_path) -> int:
    from tests.helpers.errors import seen

    raised = seen(tmp_path / "seen.jsonl")[1]
    assert raised is not None
    return raised


def test_logging_hook_logs_the_first_step_then_every_n_after_it(caplog):
    # X16, TF's row: every_n_iter=10 -> logged at run 1, 11, 21, 31; not at 32.
    hook = LoggingHook(every_steps=10)
    hook.begin(SimpleNamespace(start_step=0))
    with caplog.at_level(logging.INFO, logger="dtrain"):
        for step in (1, 5, 10, 11, 20, 21, 30, 31, 32):
            hook.after_step(StepContext(step, {"loss": 0.5}))
    assert [int(r.getMessage().split()[1]) for r in caplog.records] == [1, 11, 21, 31]


def test_logging_hook_chosen_tensors_and_at_end_in_a_run(inproc_client, run_dir, caplog):
    # X16: `tensors` chooses the values; `at_end` logs the final ones once more, at the last step.
    s = spec("""
training: {mode: sync, steps: 40}
summary: {every_steps: 10, tensorboard: false}
hooks: [{type: logging, every_steps: 15, at_end: true, tensors: [loss, learning_rate]}]
""")
    with caplog.at_level(logging.INFO, logger="dtrain"):
        summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and summary["global_step"] == 40
    lines = [r.getMessage() for r in caplog.records if r.name == "dtrain" and r.getMessage().startswith("step ")]
    assert all(re.fullmatch(r"step \d+: loss = (n/a|[\d.e+-]+), learning_rate = 0\.1", m) for m in lines), lines
    steps = [int(m.split()[1].rstrip(":")) for m in lines]
    assert len(steps) >= 2 and steps[-1] == 40  # at_end: the final step
    assert all(b - a >= 15 for a, b in zip(steps[:-2], steps[1:-1], strict=True)), steps  # then every 15
    final = lines[-1]
    assert final.split("loss = ")[1].split(",")[0] == f"{summary['final_loss']:.4g}"  # the final values


def test_nan_guard_warn_mode_stops_cleanly_at_the_first_nan(inproc_client, run_dir, caplog):
    # X18: NanTensorHook(fail_on_nan_loss=False): a warning, a requested stop, no exception; the ps
    # refused the NaN update, so the final checkpoint and model.pt hold the last good parameters.
    s = dtrain.loads(nan_pipeline("nan-warn", 40, keep=10, hooks=[{"type": "nan_guard", "mode": "warn"}]), base_dir=".")
    with caplog.at_level(logging.WARNING):
        summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed" and "error" not in summary
    assert summary["stop_reason"].startswith("nan_guard: replica ") and "non-finite" in summary["stop_reason"]
    assert summary["global_step"] == 40
    assert summary["checkpoints"] == [f"ckpt-{s:08d}" for s in (0, 15, 30, 40)]
    assert all(torch.isfinite(sh["params"]).all() for sh in ckpt.latest(run_dir).payload["shards"])
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in model.values())
    assert any("nan_guard" in r.getMessage() and "mode: warn" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ the run view


def test_begin_and_end_see_a_read_only_view_of_the_run(inproc_client, run_dir, tmp_path):
    """``begin``/``end`` get a RunView, not the session: what the run reached, read when asked; a
    stop asked for in ``begin`` ends the run cleanly at the first step observed."""
    seen = tmp_path / "seen.json"
    s = spec(f"""
training: {{mode: async, steps: 20000}}
summary: {{every_steps: 10, tensorboard: false}}
hooks: [{{type: "tests.helpers.hooks:StopAtBegin", args: {{path: "{seen}"}}}}]
""")
    summary = dtrain.run(s, client=inproc_client, run_dir=run_dir).summary
    got = json.loads(seen.read_text())
    assert summary["status"] == "completed" and summary["stop_reason"] == "asked in begin"
    assert summary["global_step"] < 20000
    assert got["begin_step"] == got["start_step"] == 0 and got["shards"] == 2
    assert got["run_id"] == summary["run_id"] and got["run_dir"] == str(run_dir)
    assert got["end_step"] == summary["global_step"] and got["stop_reason"] == "asked in begin"


def test_a_run_view_cannot_be_written_through():
    from dtrain.chief.context import RunContext, RunState
    from dtrain.chief.hooks import RunView

    s = spec("training: {mode: async, steps: 10}")
    state = RunState(dtrain.compile(s))
    view = RunView(RunContext(s, SimpleNamespace(dashboard_link=None), run_dir=None, token="t"), state)
    state.global_step, state.records = 7, [{"step": 7, "loss": 0.5, "time": 1.0}]
    assert (view.step, view.metrics["loss"], view.dashboard_link) == (7, 0.5, None)
    with pytest.raises(AttributeError):
        view.step = 8  # type: ignore[misc]
    view.spec.training.steps = 99  # a copy
    assert s.training.steps == 10
    assert isinstance(view.records, tuple) and view.records[0]["step"] == 7  # a copy of the list
