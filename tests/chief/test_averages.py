"""training.moving_average on the in-process cluster: the ps's averages follow every applied step
(against TF's formula over single-process training's trajectory), model.pt holds them with
use_for_eval and the raw variables without, and a checkpoint carries them through a resume (the
same placement: bit-identical; another: resharded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.plan.layout import ShardLayout
from dtrain.ps.averages import decay_at
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import pipeline_yaml
from tests.helpers.reference import single_process

TOLERANCE = 1e-5

def ema_spec(*, ps: int = 2, placement: str = "partitioned", replication: str = "between_graph", stages: bool = False,
             steps: int = 20, decay: float = 0.8, num_updates: bool = True, use_for_eval: bool = True,
             mode: str = "sync", workers: int = 2) -> dtrain.PipelineSpec:
    dev0, dev1 = ({"device": "/job:worker/task:0"}, {"device": "/job:worker/task:1"}) if stages else ({}, {})
    model = {"input_shape": [64], "layers": [{"type": "linear", "out": 16, **dev0}, {"type": "relu", **dev0},
                                             {"type": "linear", "out": 10, **dev1}],
             "loss": "cross_entropy"}
    average = {"decay": decay, "num_updates": num_updates, "use_for_eval": use_for_eval}
    return dtrain.loads(pipeline_yaml(
        "ema", jobs={"ps": ps, "worker": workers}, model=model, placement={"variables": placement, "min_slice_bytes": 64},
        data={"source": "sklearn:digits", "batch_size": 8}, optimizer={"name": "sgd", "lr": 0.2},
        training={"mode": mode, "replication": replication, "steps": steps, "seed": 3, "moving_average": average},
        checkpoint={"every_steps": 10, "keep": 5}), base_dir=".")


def reference_average(spec: dtrain.PipelineSpec, replicas: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """TF's ExponentialMovingAverage over single-process training's parameters, updated after
    every step (num_updates: the step after it), starting from the initial values; and the model."""
    ema = spec.training.moving_average
    shadow: dict[str, torch.Tensor] = {}

    def follow(step: int, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            if step == 0:
                shadow[name] = p.detach().clone()
            else:
                d = decay_at(ema.decay, step if ema.num_updates else None)
                shadow[name] -= (1 - d) * (shadow[name] - p.detach())  # TF's assign_moving_average

    model = single_process(spec, replicas, on_step=follow)
    return shadow, model


def _unpack(spec: dtrain.PipelineSpec, shards: list[dict], key: str) -> dict[str, torch.Tensor]:
    model = dtrain.build_model(spec)
    layout = ShardLayout.from_plan(dtrain.compile(spec))
    return layout.unpack([s[key] for s in shards], {n: p.shape for n, p in model.named_parameters()})


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() <= b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _final(run_dir: Path) -> ckpt.Checkpoint:
    found = ckpt.latest(run_dir)
    assert found is not None
    return found


@pytest.mark.parametrize(("ps", "mode", "replication", "stages", "replicas"), [
    (2, "sync", "between_graph", False, 2),  # SyncReplicasOptimizer(variable_averages=...)
    (1, "sync", "in_graph", False, 2),
    (1, "sync", "between_graph", True, 1),  # one replica of two pipeline stages, each with its own shard
    (2, "async", "between_graph", False, 1),  # one async replica: every push applied, in order
])
def test_averages_follow_every_applied_step_and_become_model_pt(inproc_client, tmp_path, ps, mode, replication,
                                                               stages, replicas):
    spec = ema_spec(ps=ps, mode=mode, replication=replication, stages=stages,
                    workers=2 if stages or replicas == 2 else 1)
    spec.training.overlap = False if mode == "async" else None  # async: each push on the last reply (plain SGD)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 20

    expected, trained = reference_average(spec, replicas)
    raw = {n: p.detach() for n, p in trained.named_parameters()}
    model_pt = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert _diff(expected, model_pt) <= TOLERANCE  # the averages, updated after each of the 20 steps
    assert _diff(raw, model_pt) > 1e-3  # not the trained variables
    final = _final(tmp_path / "run")
    assert final.step == 20
    averages = _unpack(spec, final.payload["shards"], "averages")
    assert all(torch.equal(averages[n], model_pt[n]) for n in averages)  # model.pt: exactly the ps's averages
    assert _diff(raw, _unpack(spec, final.payload["shards"], "params")) <= TOLERANCE


def test_the_averages_lag_without_num_updates_and_use_for_eval_false_keeps_the_variables(inproc_client, tmp_path):
    spec = ema_spec(num_updates=False, use_for_eval=False, decay=0.9)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    expected, trained = reference_average(spec, 2)
    model_pt = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    shards = _final(tmp_path / "run").payload["shards"]
    params, averages = _unpack(spec, shards, "params"), _unpack(spec, shards, "averages")
    assert all(torch.equal(params[n], model_pt[n]) for n in params)  # model.pt: the raw variables
    assert _diff({n: p.detach() for n, p in trained.named_parameters()}, model_pt) <= TOLERANCE
    assert _diff(expected, averages) <= TOLERANCE  # still kept (and checkpointed), with decay 0.9 throughout
    assert _diff(averages, model_pt) > 1e-3
    assert result.summary["status"] == "completed"


def test_a_resume_keeps_the_averages(inproc_client, tmp_path):
    """Stopped at step 10 and resumed to 20: the averages go on from the checkpoint's, bit for bit
    the uninterrupted run's; resumed under another number of ps tasks they are resharded."""
    spec = ema_spec()
    dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "ref")
    ref = _unpack(spec, _final(tmp_path / "ref").payload["shards"], "averages")
    first = ema_spec(steps=10)
    for run, resumed_spec in (("same", spec), ("other", ema_spec(ps=3, placement="round_robin"))):
        dtrain.run(first, client=inproc_client, run_dir=tmp_path / run)
        at_10 = _unpack(first, _final(tmp_path / run).payload["shards"], "averages")
        result = dtrain.run(resumed_spec, client=inproc_client, run_dir=tmp_path / run, resume=True)
        assert result.summary["start_step"] == 10 and result.summary["global_step"] == 20
        got = _unpack(resumed_spec, _final(tmp_path / run).payload["shards"], "averages")
        if run == "same":
            assert all(torch.equal(got[n], ref[n]) for n in ref)
        else:
            assert _diff(got, ref) <= 1e-6
        assert _diff(at_10, ref) > 1e-3  # the averages moved on after the resume


def test_the_golden_pipeline_evaluates_the_averages(inproc_client, tmp_path):
    """pipelines/digits_averages.yaml, in full: the averages (model.pt, the final evaluation) reach
    the accuracy of plain sync training."""
    spec = dtrain.load(PIPELINES / "digits_averages.yaml", overrides=["summary.tensorboard=false"])
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 400
    assert result.summary["eval"]["accuracy"] >= 0.93
    final = _final(tmp_path / "run")
    averages = _unpack(spec, final.payload["shards"], "averages")
    model_pt = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.equal(averages[n], model_pt[n]) for n in averages)
