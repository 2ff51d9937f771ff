"""Shard layouts: parameters <-> flat shard buffers and their buckets, on real models."""

from __future__ import annotations

import pytest
import torch

import dtrain
from dtrain.plan.layout import ShardLayout, reshard
from tests.helpers.layouts import bound


@pytest.mark.parametrize("bucket_numel", [1, 100, 600, 10_000])
def test_buckets_tile_each_shard_from_its_end(bucket_numel):
    _, layout = bound()
    for s, numel in enumerate(layout.shard_numel):
        buckets = layout.buckets(s, bucket_numel)
        assert buckets[0][1] == numel and buckets[-1][0] == 0  # from the end down to the start
        for (lo, hi, names), nxt in zip(buckets, [*buckets[1:], None], strict=True):
            assert lo < hi and (nxt is None or nxt[1] == lo)  # contiguous, no gap, no overlap
            assert hi - lo >= bucket_numel or nxt is None  # only the last may be small
            starts = {p.offset for p in layout.parts if p.shard == s and p.param in names}
            assert min(starts) == lo  # whole parts only
        assert sorted(n for _, _, names in buckets for n in names) == sorted(
            p.param for p in layout.parts if p.shard == s)


RESHARD_SPEC = """
name: reshard
cluster: {jobs: {ps: PS, worker: 1}}
model:
  input_shape: [16]
  layers: [{type: linear, out: 32}, {type: relu}, {type: linear, out: 32}, {type: relu}, {type: linear, out: 4}]
placement: {variables: STRATEGY, min_slice_bytes: 256}
data: {source: synthetic, num_samples: 64, num_classes: 4, batch_size: 8}
"""


def layout_for(ps: int, strategy: str) -> ShardLayout:
    spec = dtrain.loads(RESHARD_SPEC.replace("PS", str(ps)).replace("STRATEGY", strategy), base_dir=".")
    return ShardLayout.from_plan(dtrain.compile(spec))


@pytest.mark.parametrize(("src", "dst"), [((2, "round_robin"), (1, "round_robin")),
                                          ((1, "round_robin"), (3, "partitioned")),
                                          ((3, "partitioned"), (2, "greedy")),
                                          ((2, "greedy"), (3, "round_robin"))])
def test_reshard_moves_every_variable_and_its_optimizer_state(src, dst):
    old, new = layout_for(*src), layout_for(*dst)
    assert not old.same_as(new)
    torch.manual_seed(0)
    numel = {p.param: 0 for p in old.parts}
    for p in old.parts:
        numel[p.param] = max(numel[p.param], p.start + p.numel)
    params = {n: torch.randn(k) for n, k in numel.items()}
    moments = {n: torch.rand(k) for n, k in numel.items()}
    states = [{"params": buf, "step": 7 + i, "samples": 99,
               "optimizer_state": {"step": 5, "exp_avg": mom, "exp_avg_sq": mom * 2}}
              for i, (buf, mom) in enumerate(zip(old.pack(params), old.pack(moments), strict=True))]
    out = reshard(states, old, new)
    assert len(out) == new.num_shards and [s["params"].numel() for s in out] == new.shard_numel
    back = new.unpack_flat([s["params"] for s in out], numel)
    assert all(torch.equal(back[n], params[n]) for n in numel)
    back = new.unpack_flat([s["optimizer_state"]["exp_avg_sq"] for s in out], numel)
    assert all(torch.equal(back[n], moments[n] * 2) for n in numel)
    assert all(s["optimizer_state"]["step"] == 5 and s["step"] == 7 and s["samples"] == 99 for s in out)
    assert ShardLayout.from_description(old.describe()).same_as(old)


def test_reshard_refuses_layouts_of_other_variables():
    old = layout_for(2, "round_robin")
    other = ShardLayout.from_plan(dtrain.compile(dtrain.loads(
        RESHARD_SPEC.replace("PS", "2").replace("STRATEGY", "round_robin").replace("out: 4", "out: 5"),
        base_dir=".")))
    states = [{"params": torch.zeros(n), "step": 0} for n in old.shard_numel]
    with pytest.raises(ValueError, match="different variables"):
        reshard(states, old, other)
