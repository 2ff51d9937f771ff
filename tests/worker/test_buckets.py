"""Gradient buckets sent during a real backward, last layers first."""

from __future__ import annotations

import torch

from dtrain.worker.buckets import GradBuckets
from tests.helpers.layouts import bound


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
