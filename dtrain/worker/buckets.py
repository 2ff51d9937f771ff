"""DDP-style gradient buckets: a shard's gradient sent in parts while backward still runs,
last layers first, when its bytes cross a socket (``training.bucket_mb``). Pure torch."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.plan.layout import BoundModel


class GradBuckets:
    """DDP-style gradient bucketing for pushes whose bytes cross a socket (``training.bucket_mb``).

    Each shard's buffer is cut into buckets from its end (backward's first gradients) to its
    start. A hook on every parameter (``register_post_accumulate_grad_hook``) counts the gradients
    that backward has finished; once every bucket from the end down to one is complete, those
    are sent at once (``handle.send_part``) while backward goes on with the earlier layers. After
    backward, the push sends only the head that is still unsent. Needs zero-copy gradients (they
    are written straight into the buffers that are sent)."""

    def __init__(self, bound: BoundModel, shards: list[Any], bucket_numel: int):
        self.shards = shards
        self.numel = list(bound.layout.shard_numel)
        self.buckets: dict[int, list[tuple[int, int, list[str]]]] = {}
        self._where: dict[str, list[tuple[int, int]]] = {}
        for s, handle in enumerate(shards):
            if getattr(handle, "sends_parts", False):
                self.buckets[s] = bound.layout.buckets(s, bucket_numel)
                for b, (_lo, _hi, names) in enumerate(self.buckets[s]):
                    for name in names:
                        self._where.setdefault(name, []).append((s, b))
        self._grads: list[torch.Tensor] | None = None
        self._pending: dict[tuple[int, int], int] = {}
        self._next: dict[int, int] = {}
        self._cut: dict[int, int] = {}
        self._handles = []
        for name, param in bound.model.named_parameters():
            if name in self._where and param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook_for(name)))
        self.parts_sent = 0

    @property
    def active(self) -> bool:
        return bool(self.buckets)

    def _hook_for(self, name: str) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if self._grads is None:
                return
            for key in self._where[name]:
                self._pending[key] -= 1
                if self._pending[key] == 0:
                    self._flush(key[0])
        return hook

    def _flush(self, s: int) -> None:
        buckets = self.buckets[s]
        while self._next[s] < len(buckets) and self._pending[(s, self._next[s])] == 0:
            lo, hi, _ = buckets[self._next[s]]
            assert self._grads is not None  # a step's gradients are bound (begin)
            self.shards[s].send_part(self._grads[s], lo, hi)
            self.parts_sent += 1
            self._cut[s] = lo
            self._next[s] += 1

    def begin(self, grads: list[torch.Tensor]) -> None:
        """Before a step's backward: ``grads`` are the buffers it writes."""
        self._grads = grads
        self._pending = {(s, b): len(names) for s, bs in self.buckets.items() for b, (_, _, names) in enumerate(bs)}
        self._next = dict.fromkeys(self.buckets, 0)
        self._cut = {s: self.numel[s] for s in self.buckets}

    def end(self) -> list[int | None]:
        """After backward: per shard, the head still to send (None: the whole gradient)."""
        self._grads = None
        return [self._cut.get(s) for s in range(len(self.shards))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
