"""The ps shard's sync push under ``training.sync_tokens``: TensorFlow's token queue
(:class:`dtrain.ps.tokens.TokenSync` decides; ``TokenPush``, a part of ``ParameterShard``,
carries it out).

Unlike the default sync push (a barrier: it returns once the gradient's step is applied), a push
here is TensorFlow's train_op: accumulate the gradient unless its local step is stale (or apply
the mean when it completes the update: the barrier's body, ``SyncBarrier.accumulate``), then
dequeue one token — the only wait, while the queue is empty — and reply with the current
parameters and the token's value as the step: the replica tags its next gradient with it (its
``local_step``). No Dask here; the data plane and the actor path both reach it through
``ParameterShard.push_sync``.
"""

from __future__ import annotations

import torch

from .control import ShardControl
from .core import ShardCore
from .replication import Apply
from .sparse import Reply, Sparse
from .sync_push import SyncBarrier
from .tokens import TokenSync
from .waits import ShardWaits


class TokenPush:
    """``push_sync`` with tokens (see the module docstring)."""

    def __init__(self, core: ShardCore, waits: ShardWaits, control: ShardControl, barrier: SyncBarrier,
                 tokens: TokenSync):
        """``control``: the holds a push obeys; ``barrier``: whose body accumulates the gradient;
        ``tokens``: the shard's step source (``core.sync``), its token queue."""
        self.core = core
        self.waits = waits
        self.control = control
        self.barrier = barrier
        self.tokens = tokens

    async def push(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                   local_step: int, out: torch.Tensor | None, sparse: Sparse | None) -> Reply:
        core, waits, control, tokens = self.core, self.waits, self.control, self.tokens
        cond = waits.condition()
        while True:
            await control.wait_unheld(version)
            async with cond:
                with waits.lock:
                    if control.still_held(version):  # a hold placed while this push waited for the condition
                        continue
                    if core.stop or core.error is not None or core.bad_ids(sparse, replica):
                        decision = None
                    else:
                        decision = self.barrier.accumulate(grad, replica, version, loss, samples, local_step, sparse)
                if decision is None or isinstance(decision, Apply):  # applied (tokens_per_step new tokens), or failed
                    cond.notify_all()
                if core.stop or core.error is not None:
                    return core.sparse_reply(out, sparse)
                token = tokens.take(replica)
                if token is None:  # TF blocks on the dequeue; dtrain fails after barrier_timeout_s instead
                    await waits.wait(cond, lambda: bool(tokens.tokens) or core.stop or core.error is not None,
                                     f"replica {replica} waited for a sync token after its gradient of local step "
                                     f"{version} (global step {tokens.step}; sync_tokens)")
                    if core.stop or core.error is not None:
                        return core.sparse_reply(out, sparse)
                    token = tokens.take(replica)
                reply = core.sparse_reply(out, sparse)
                return (reply[0], token, *reply[2:])
