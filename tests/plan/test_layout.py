"""Shard layouts: parameters <-> flat shard buffers and their buckets, on real models."""

from __future__ import annotations

import pytest
import torch

import dtrain
from dtrain.plan.layout import BoundModel, ShardLayout, reshard
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


def test_reshard_moves_the_moving_averages_elementwise():
    """training.moving_average: each shard's ``averages`` buffer is regrouped like its variables
    (never copied from shard 0)."""
    old, new = layout_for(3, "partitioned"), layout_for(2, "greedy")
    numel: dict[str, int] = {}
    for p in old.parts:
        numel[p.param] = max(numel.get(p.param, 0), p.start + p.numel)
    torch.manual_seed(1)
    params = {n: torch.randn(k) for n, k in numel.items()}
    averages = {n: torch.randn(k) for n, k in numel.items()}
    states = [{"params": buf, "averages": avg, "step": 3}
              for buf, avg in zip(old.pack(params), old.pack(averages), strict=True)]
    out = reshard(states, old, new)
    assert [s["averages"].numel() for s in out] == new.shard_numel
    back = new.unpack_flat([s["averages"] for s in out], numel)
    assert all(torch.equal(back[n], averages[n]) for n in numel)
    plain = reshard([{k: v for k, v in s.items() if k != "averages"} for s in states], old, new)
    assert all("averages" not in s for s in plain)  # none written: none made up


def test_reshard_refuses_layouts_of_other_variables():
    old = layout_for(2, "round_robin")
    other = ShardLayout.from_plan(dtrain.compile(dtrain.loads(
        RESHARD_SPEC.replace("PS", "2").replace("STRATEGY", "round_robin").replace("out: 4", "out: 5"),
        base_dir=".")))
    states = [{"params": torch.zeros(n), "step": 0} for n in old.shard_numel]
    with pytest.raises(ValueError, match="different variables"):
        reshard(states, old, other)


# ------------------------------------------------------------------ parts along an inner axis

def partitioned_layout(ps: int, placement: str) -> ShardLayout:
    text = RESHARD_SPEC.replace("PS", str(ps)).replace("placement: {variables: STRATEGY, min_slice_bytes: 256}",
                                                          f"placement: {placement}")
    return ShardLayout.from_plan(dtrain.compile(dtrain.loads(text, base_dir=".")))


def test_an_axis_1_part_holds_its_columns():
    """Each part of a 32x16 weight split in 3 along axis 1 is that block of columns, row by row,
    in its shard buffer: [:, 0:6], [:, 6:11], [:, 11:16] (TensorFlow's slicing)."""
    layout = partitioned_layout(2, "{partitioner: {type: fixed_size, num_shards: 3, axis: 1}}")
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    shapes = {"0.weight": torch.Size([32, 16]), "0.bias": torch.Size([32]), "2.weight": torch.Size([32, 32]),
              "2.bias": torch.Size([32]), "4.weight": torch.Size([4, 32]), "4.bias": torch.Size([4])}
    params = {n: (w if n == "0.weight" else torch.randn(s)) for n, s in shapes.items()}
    bufs = layout.pack(params)
    parts = [p for p in layout.parts if p.param == "0.weight"]
    assert [(p.start, p.blocks, p.stride, p.numel) for p in parts] == [(0, 32, 16, 192), (6, 32, 16, 160),
                                                                       (11, 32, 16, 160)]
    for p, (lo, hi) in zip(parts, [(0, 6), (6, 11), (11, 16)], strict=True):
        assert torch.equal(bufs[p.shard][p.offset:p.offset + p.numel], w[:, lo:hi].reshape(-1))
    back = layout.unpack(bufs, shapes)
    assert all(torch.equal(back[n], params[n]) for n in shapes)
    assert ShardLayout.from_description(layout.describe()).same_as(layout)


def test_a_bound_model_copies_axis_1_parts_both_ways():
    """load_params / grads_into go through the strided parts: the model gets each part's columns,
    and the gradient buffers get the gradient's."""
    layout = partitioned_layout(2, "{partitioner: {type: min_max, max_partitions: 3, min_slice_size: 512, axis: 1}}")
    spec = dtrain.loads(RESHARD_SPEC.replace("PS", "2").replace("STRATEGY", "round_robin"), base_dir=".")
    model = dtrain.build_model(spec)
    bound_model = BoundModel(model, layout)
    assert not bound_model.zero_copy and any(p.blocks > 1 for p in layout.parts)
    torch.manual_seed(1)
    want = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    for s, buf in enumerate(layout.pack(want)):
        bound_model.load_params(s, buf)
    assert all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        p.grad = want[n] * 3
    bufs = bound_model.new_buffers()
    bound_model.grads_into(bufs)
    got = layout.unpack(bufs, {n: p.shape for n, p in model.named_parameters()})
    assert all(torch.equal(got[n], want[n] * 3) for n in want)


@pytest.mark.parametrize(("src", "dst"), [
    ((2, "{variables: partitioned, min_slice_bytes: 256}"), (2, "{partitioner: {type: fixed_size, num_shards: 3, axis: 1}}")),
    ((3, "{partitioner: {type: fixed_size, num_shards: 3, axis: 1}}"),
     (2, "{partitioner: {type: min_max, max_partitions: 5, min_slice_size: 512, axis: 1}}")),
    ((2, "{partitioner: {type: variable_axis_size, max_shard_bytes: 300, axis: 1}}"), (1, "{}")),
])
def test_reshard_between_partitionings(src, dst):
    old, new = partitioned_layout(*src), partitioned_layout(*dst)
    assert not old.same_as(new)
    torch.manual_seed(0)
    numel = {}
    for p in old.parts:
        numel[p.param] = max(numel.get(p.param, 0), p.end)
    params = {n: torch.randn(k) for n, k in numel.items()}
    states = [{"params": buf, "step": 3, "optimizer_state": {"momentum_buffer": buf * 2}} for buf in old.pack(params)]
    out = reshard(states, old, new)
    back = new.unpack_flat([s["params"] for s in out], numel)
    assert all(torch.equal(back[n], params[n]) for n in numel)
    back = new.unpack_flat([s["optimizer_state"]["momentum_buffer"] for s in out], numel)
    assert all(torch.equal(back[n], params[n] * 2) for n in numel)


def test_zero_copy_views_follow_the_alternating_buffers():
    """The data plane alternates two persistent buffer sets of each kind; the cached views must
    follow them: parameters read the buffer of the last reply, and backward's gradients land in
    the set given for this step (and only there), step after step."""
    bound_model, layout = bound()
    assert bound_model.zero_copy
    model = bound_model.model
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    params = [bound_model.new_buffers(), bound_model.new_buffers()]
    grads = [bound_model.new_buffers(), bound_model.new_buffers()]
    for k in range(6):
        for s in range(layout.num_shards):
            params[k % 2][s].copy_(torch.linspace(-1, 1, params[k % 2][s].numel()) * (k + 1))
            bound_model.params_as_views(s, params[k % 2][s])
        want = {n: t.clone() for n, t in layout.unpack(params[k % 2], {n: p.shape for n, p in model.named_parameters()}).items()}
        assert all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())
        for g in grads[(k + 1) % 2]:
            g.fill_(7.0)  # the other set: must stay untouched by this step's backward
        bound_model.grads_as_views(grads[k % 2])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.cross_entropy(model(x), y).backward()  # the same step, plain autograd
        assert all(torch.allclose(expected[n], p.grad) for n, p in model.named_parameters())
        got = layout.unpack(grads[k % 2], {n: p.shape for n, p in model.named_parameters()})
        assert all(torch.allclose(got[n], p.grad) for n, p in model.named_parameters())
        assert all(torch.equal(g, torch.full_like(g, 7.0)) for g in grads[(k + 1) % 2])
