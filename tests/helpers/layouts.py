"""A small model bound to its shard layout (two ps tasks by default), for layout and bucket tests."""

from __future__ import annotations

import torch

import dtrain
from dtrain.plan.layout import BoundModel, ShardLayout

SPEC = """
name: layout
cluster: {jobs: {ps: 2, worker: 1}}
model:
  input_shape: [16]
  layers: [{type: linear, out: 32}, {type: relu}, {type: linear, out: 32}, {type: relu}, {type: linear, out: 4}]
data: {source: synthetic, num_samples: 64, num_classes: 4, batch_size: 8}
optimizer: {name: sgd, lr: 0.1}
"""


def bound(ps: int = 2) -> tuple[BoundModel, ShardLayout]:
    spec = dtrain.loads(SPEC.replace("ps: 2", f"ps: {ps}"), base_dir=".")
    layout = ShardLayout.from_plan(dtrain.compile(spec))
    torch.manual_seed(0)
    return BoundModel(dtrain.build_model(spec), layout), layout
