"""A pipeline stage on its own (no cluster): it holds only its own layers, and their memory only."""

from __future__ import annotations

import os
import sys

import psutil
import pytest
import torch

import dtrain
from dtrain.worker.stages import StageModel, link_shape, stage_layout


def reset_peak() -> None:
    """Reset this process's peak RSS (Linux: VmHWM), so the next reading is the peak from now on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def spec(width: int) -> dtrain.PipelineSpec:
    return dtrain.loads(f"""
name: lean-stage
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  input_shape: [{width}]
  layers:
    - {{type: linear, out: {width}, device: /job:worker/task:0}}
    - {{type: batch_norm1d, device: /job:worker/task:1}}
    - {{type: linear, out: 10, device: /job:worker/task:1}}
data: {{source: synthetic, num_samples: 64, batch_size: 8}}
training: {{microbatches: 2}}
""", base_dir=".")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets the peak RSS in /proc")
def test_a_later_stage_allocates_only_its_own_layers():
    """The first layer is 12,000 x 12,000 floats (576 MB): the second stage must not build it."""
    s = spec(12_000)
    plan = dtrain.compile(s)
    rss = psutil.Process(os.getpid()).memory_info().rss
    reset_peak()
    stage = StageModel(s, plan, 0, 1, up=None, down=None)
    grown = peak() - rss
    assert grown < 200 << 20, f"building the stage took the process's peak {grown >> 20} MB higher"
    names = [n for n, _ in stage.model.named_parameters()]
    assert names == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert stage_layout(plan, 1).shard_numel == [12_000 * 2 + 12_000 * 10 + 10]
    # Buffers are initialised, not left as the empty memory they were materialised in.
    bn = stage.model.get_submodule("1")
    assert torch.equal(bn.running_mean, torch.zeros(12_000)) and torch.equal(bn.running_var, torch.ones(12_000))


def test_the_link_regions_hold_a_micro_batch_and_its_labels():
    s = spec(16)
    plan = dtrain.compile(s)
    microbatches, capacity = link_shape(s, plan, 0)
    assert microbatches == 2
    assert capacity >= 4 * 4 * 16 + 4 * 8 and capacity % 64 == 0  # 4 examples of 16 floats, int64 labels
    off = dtrain.loads(s.model_dump_json(), base_dir=".", overrides=["training.shared_memory=false"])
    assert link_shape(off, plan, 0) is None
