"""Shard layouts, zero-copy gradient views and gradient buckets: real models, real backward."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import dtrain
from dtrain.plan.layout import BoundModel, ShardLayout
from dtrain.worker.replica import GradBuckets, pin_compute_thread

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


class Recorder:
    """A shard handle that records the buckets sent and what backward had finished by then."""

    sends_parts = True

    def __init__(self, first_weight: torch.Tensor):
        self.first_weight = first_weight
        self.parts: list[tuple[int, int, torch.Tensor, bool]] = []

    def send_part(self, grad: torch.Tensor, start: int, end: int) -> None:
        first_layer_done = bool(self.first_weight.grad.abs().sum() > 0)
        self.parts.append((start, end, grad[start:end].clone(), first_layer_done))


def test_grad_buckets_send_during_backward_and_leave_the_head():
    b, layout = bound(ps=1)
    model = b.model
    first = next(p for n, p in model.named_parameters() if n.endswith("weight"))
    rec = Recorder(first)
    buckets = GradBuckets(b, [rec], bucket_numel=100)
    grads = b.new_buffers()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    buckets.begin(grads)
    b.grads_as_views(grads)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    (head,) = buckets.end()
    assert len(rec.parts) == 3 and head == 0  # 3 buckets of >= 100 (a layer each): all went as parts
    # sent from the end down, each while the first layer's gradient was still being computed
    assert rec.parts[0][1] == layout.shard_numel[0]
    assert [p[1] for p in rec.parts[1:]] == [p[0] for p in rec.parts[:-1]]
    assert rec.parts[-1][0] == head
    assert not rec.parts[0][3] and not rec.parts[1][3] and rec.parts[2][3]
    # what was sent is exactly the final gradient there (backward never touched it again)
    for start, end, sent, _ in rec.parts:
        assert torch.equal(sent, grads[0][start:end])
    # between steps the hooks do nothing; removed, they are gone
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert len(rec.parts) == buckets.parts_sent
    buckets.remove()
    buckets.begin(grads)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert len(rec.parts) == buckets.parts_sent


def test_shards_without_parts_get_no_buckets():
    b, _ = bound(ps=2)

    class SharedMemoryHandle:
        sends_parts = False

    buckets = GradBuckets(b, [SharedMemoryHandle(), SharedMemoryHandle()], bucket_numel=10)
    assert not buckets.active
    buckets.begin(b.new_buffers())
    assert buckets.end() == [None, None]
    buckets.remove()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_compute_thread_pins_only_the_calling_thread():
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def replica(rank: int) -> None:
        before = os.sched_getaffinity(0)
        seen[f"cpus{rank}"] = pin_compute_thread(rank, threads=1)
        seen[f"now{rank}"] = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, before)

    for rank in (0, 1, len(allowed)):
        t = threading.Thread(target=replica, args=(rank,))
        t.start()
        t.join()
    assert seen["cpus0"] == seen["now0"] == [allowed[0]]
    assert seen["cpus1"] == [allowed[1 % len(allowed)]]
    assert seen[f"cpus{len(allowed)}"] == [allowed[0]]  # wraps around
    assert sorted(os.sched_getaffinity(0)) == allowed  # this thread was never pinned
