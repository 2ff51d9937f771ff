"""The ps shard's sync push under ``training.sync_tokens``: TensorFlow's token queue
(:class:`dtrain.ps.tokens.TokenSync` decides; this mixin of ``ParameterShard`` carries it out).

Unlike the default sync push (a barrier: it returns once the gradient's step is applied), a push
here is TensorFlow's train_op: accumulate the gradient unless its local step is stale (or apply
the mean when it completes the update), then dequeue one token — the only wait, while the queue
is empty — and reply with the current parameters and the token's value as the step: the replica
tags its next gradient with it (its ``local_step``). No Dask here; the data plane and the actor
path both reach it through ``ParameterShard.push_sync``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from .replication import Apply, SyncAggregator
from .sparse import Reply, Sparse
from .tokens import TokenSync


def sync_for(config: dict[str, Any], num_replicas: int) -> SyncAggregator | TokenSync:
    """The shard's sync state machine: the token queue under ``sync_tokens``, else the barrier."""
    to_aggregate = config.get("replicas_to_aggregate") or num_replicas
    if config.get("sync_tokens"):
        return TokenSync(to_aggregate, num_replicas, init_tokens=config.get("init_tokens"))
    return SyncAggregator(to_aggregate, num_replicas, fraction=config.get("aggregate_fraction"))


class TokenPush:
    """``push_sync`` with tokens (see the module docstring). Uses the shard's state and helpers."""

    sync: Any
    acc: torch.Tensor
    stop: bool
    error: str | None
    lock: Any

    @property
    def uses_tokens(self) -> bool:
        return isinstance(self.sync, TokenSync)

    async def _push_token(self, grad: torch.Tensor, replica: int, version: int, loss: float | None,
                          samples: int, local_step: int, out: torch.Tensor | None, sparse: Sparse | None) -> Reply:
        shard: Any = self
        cond: asyncio.Condition = shard._condition()
        while True:
            await shard._wait_unheld(version)
            async with cond:
                with self.lock:
                    if shard._still_held(version):  # a hold placed while this push waited for the condition
                        continue
                    if self.stop or self.error is not None or shard._bad_ids(sparse, replica):
                        decision = None
                    else:
                        decision = shard._sync_accumulate(grad, replica, version, loss, samples, local_step, sparse)
                if decision is None or isinstance(decision, Apply):  # applied (tokens_per_step new tokens), or failed
                    cond.notify_all()
                if self.stop or self.error is not None:
                    return shard._sparse_reply(out, sparse)
                token = self.sync.take(replica)
                if token is None:  # TF blocks on the dequeue; dtrain fails after barrier_timeout_s instead
                    await shard._wait(cond, lambda: bool(self.sync.tokens) or self.stop or self.error is not None,
                                      f"replica {replica} waited for a sync token after its gradient of local step "
                                      f"{version} (global step {self.sync.step}; sync_tokens)")
                    if self.stop or self.error is not None:
                        return shard._sparse_reply(out, sparse)
                    token = self.sync.take(replica)
                reply = shard._sparse_reply(out, sparse)
                return (reply[0], token, *reply[2:])
