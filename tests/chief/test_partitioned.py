"""Partitioned variables (placement.partitioner) on the in-process cluster: parts split along axis 1,
more parts than ps tasks, trained in sync exactly as single-process torch, the ps shards holding
exactly TensorFlow's slices of the final model, and a checkpoint resumed under another partitioning."""

from __future__ import annotations

import json

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.plan.layout import ShardLayout
from dtrain.spec.partitioner import FixedSizePartitioner
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import PARTITIONED, stage_spec
from tests.helpers.reference import max_abs_diff, single_process

SPEC = PARTITIONED


def _slice_of(param: torch.Tensor, slice_spec: str) -> torch.Tensor:
    """The part a TensorFlow save-slice spec ("16 64 0,16:22,21") names, cut with torch's own indexing."""
    *full, slices = slice_spec.split(" ")
    assert [int(d) for d in full] == list(param.shape)
    index = tuple(slice(int(a), int(a) + int(n)) for a, n in (s.split(",") for s in slices.split(":")))
    return param[index]


def test_axis_1_parts_train_like_one_process_and_the_ps_hold_their_slices(inproc_client, tmp_path):
    spec = dtrain.loads(SPEC, base_dir=".")
    plan = dtrain.compile(spec)
    parts = [v for v in plan.variables if v.slice_spec]
    # 0.weight [16, 64] and 2.weight [10, 16] in 3 column blocks each, over 2 ps tasks, round robin.
    assert [(v.name, v.shape, v.shard) for v in parts] == [
        ("0.weight/part_0", (16, 22), 0), ("0.weight/part_1", (16, 21), 1), ("0.weight/part_2", (16, 21), 0),
        ("2.weight/part_0", (10, 6), 0), ("2.weight/part_1", (10, 5), 1), ("2.weight/part_2", (10, 5), 0)]

    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 60
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0] * 0.5  # it learns
    assert max_abs_diff(result.model, single_process(spec, 2)) <= 1e-5  # exactly as one process would

    # The ps shards (the final checkpoint) hold each part's slice of the final model, as TF's save
    # slice spec names it: a part mapped to the wrong columns fails here.
    shards = ckpt.latest(tmp_path / "run").payload["shards"]
    final = dict(result.model.named_parameters())
    for v in plan.variables:
        want = _slice_of(final[v.source].detach(), v.slice_spec) if v.slice_spec else final[v.source].detach()
        assert torch.equal(shards[v.shard]["params"][v.offset:v.offset + v.numel], want.reshape(-1)), v.name


@pytest.mark.parametrize("first", [
    ["placement.variables=partitioned", "placement.min_slice_bytes=256"],  # axis 0, one part per ps task
    ["placement.partitioner.num_shards=2", "placement.partitioner.axis=0"],
])
def test_a_checkpoint_resumes_under_another_partitioning(inproc_client, tmp_path, first):
    """Written with parts along axis 0 (or 2 parts), resumed with 3 parts along axis 1: the
    restored parameters are bit-identical to the checkpoint's, and training goes on exactly as an
    uninterrupted run's."""
    base = dtrain.loads(SPEC, base_dir=".")
    overrides = ["placement.partitioner=null", *first] if "placement.variables=partitioned" in first else first
    written = dtrain.loads(SPEC, base_dir=".", overrides=overrides)
    written.training.steps = 30
    old = ShardLayout.from_plan(dtrain.compile(written))
    new = ShardLayout.from_plan(dtrain.compile(base))
    assert not old.same_as(new)
    dtrain.run(written, client=inproc_client, run_dir=tmp_path / "run")
    at_30 = ckpt.latest(tmp_path / "run")
    assert at_30.step == 30
    shapes = {n: p.shape for n, p in dtrain.build_model(base).named_parameters()}
    saved = old.unpack([s["params"] for s in at_30.payload["shards"]], shapes)

    resumed_spec = base.model_copy(deep=True)
    resumed_spec.training.steps = 30  # nothing left to train: the model is the restored one
    restored = dtrain.run(resumed_spec, client=inproc_client, run_dir=tmp_path / "run", resume=True)
    assert restored.summary["start_step"] == 30
    for name, value in restored.model.named_parameters():
        assert torch.equal(value.detach(), saved[name]), name

    resumed = dtrain.run(base, client=inproc_client, run_dir=tmp_path / "run", resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["global_step"] == 60
    assert max_abs_diff(resumed.model, single_process(base, 2)) <= 1e-5


def test_partitioned_digits_reaches_accuracy(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "digits_partitioned.yaml", overrides=["summary.tensorboard=false"])
    assert sum(1 for v in dtrain.compile(spec).variables if v.axis == 1 and v.slice_spec) == 6
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert result.summary["eval"]["accuracy"] >= 0.95


def test_axis_1_parts_in_pipeline_stages_train_like_one_process(inproc_client, tmp_path):
    """Each stage's shards hold the parts of its own layers (stage_layout), split along axis 1."""
    spec = stage_spec(2, "{name: momentum, lr: 0.05, momentum: 0.9}", num_ps=2, steps=30)
    spec.placement.partitioner = FixedSizePartitioner(type="fixed_size", num_shards=3, axis=1)
    plan = dtrain.compile(spec)
    assert {plan.shards[v.shard].stage for v in plan.variables if v.source == "2.weight"} == {1}
    assert sum(1 for v in plan.variables if v.blocks > 1) == 9  # three weights in three column blocks
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert max_abs_diff(result.model, single_process(spec, 1)) <= 1e-5
