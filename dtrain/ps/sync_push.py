"""The ps shard's sync barrier: SyncReplicasOptimizer's push, on the event loop or on the data
plane's connection thread (a mixin of ``ParameterShard``; :class:`SyncAggregator` decides).

A sync push accumulates its gradient for the shard's current step and returns once that step has
been applied: by the quorum's last gradient (it applies the mean), by an ``excuse``/``retire`` of
a lost or finished replica, or by a stop. Two ways in, one body (:meth:`_sync_accumulate`):

- ``push_sync`` — a coroutine on the ps's event loop: the actor path (``transport: dask``), and
  the data plane's fallback while a checkpoint hold, a stop or an error is in force. A waiting
  push sleeps on the shard's ``asyncio.Condition``.
- ``push_sync_direct`` — on the data plane's connection thread, under the shard's ``lock``, with
  no hop to the event loop (that hop cost more of the ps's CPU than the apply: ps/fastpath.py).
  A waiting push sleeps on ``_tcond``, a ``threading.Condition`` on the same lock. Only where
  nothing but the barrier can make the push wait: no token queue (``sync_tokens``), no sparse
  tables, and, checked under the lock, no hold of its step, no stop and no error; else it returns
  None and the connection thread takes the event-loop path.

Both kinds of waiter are woken whichever side moves the step: ``_apply`` (always called under
``lock``) notifies ``_tcond``; a direct apply schedules the loop's wake-up when a loop waiter is
counted (``_waiting``); ``_wake`` (stop, hold, release, the lease) notifies both. The barrier's
timeout and the session's grace (``barrier_grace``) apply alike on both sides. No Dask here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from .replication import Accumulate, Apply, Decision, Drop
from .sparse import Reply, Sparse, rows_bytes


class BarrierTimeout(RuntimeError):
    """A sync replica waited ``barrier_timeout_s`` for the other replicas' gradients."""


class FencedOff(RuntimeError):
    """A push from a submission (attempt) of a replica that the session has since replaced."""


def fence(owners: dict[int, int], replica: int, attempt: int | None) -> None:
    """Refuse a push of ``replica``'s ``attempt`` when another attempt owns that replica
    (``ParameterShard.set_owner``); ``attempt`` None: a caller that does not say (no fencing)."""
    owner = owners.get(replica)
    if attempt is not None and owner is not None and owner != attempt:
        raise FencedOff(f"replica {replica}'s attempt {attempt} is fenced off: attempt {owner} owns that replica "
                        "now (a replaced replica came back)")


class SyncPush:
    """``push_sync``, ``push_sync_direct``, ``excuse`` and ``apply_mean`` (see the module docstring)."""

    owners: dict[int, int]
    lock: threading.Lock
    _tcond: threading.Condition
    _waiting: int
    sync: Any
    acc: torch.Tensor
    _first: torch.Tensor | None
    mode: str
    tables: Any  # ShardTables (ps/sparse.py)
    stop: bool
    error: str | None
    meter: Any
    gate: Any
    uses_tokens: bool
    step: Any
    _held: Any
    _still_held: Any
    _observe: Any
    _bad_grad: Any
    _bad_ids: Any
    _apply: Any
    _reply: Any
    _sparse_reply: Any
    _condition: Any
    _wait: Any
    _wait_unheld: Any
    _remaining: Any
    _push_token: Any
    _wake_waiters: Any

    @property
    def direct_sync(self) -> bool:
        """Whether sync pushes may run on the connection thread (the static conditions)."""
        return self.mode == "sync" and not self.uses_tokens

    def _sync_accumulate(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                         local_step: int, sparse: Sparse | None, borrow: bool = False) -> Decision | None:
        """The push's bookkeeping, then its gradient into the step's sum, applying the mean when it
        completes the quorum (the caller holds ``lock``). None: refused (an error, or a non-finite
        gradient under nan_guard), nothing more will be applied.

        ``borrow`` (a direct push: its connection thread waits here for the step's apply before it
        reads anything more into that gradient): a step's first gradient is read where it lies
        (``_first``) instead of being copied into ``acc``; the second is added to it into ``acc``
        in one pass, and a lone one is applied from where it lies. A push that leaves before the
        apply (its wait timed out) first copies it in (``_own_first``). The loop's pushes copy: a
        connection thread that gives up on one cancels it, and reads on, before the loop runs it."""
        self._observe(replica, loss, samples, local_step)
        if self.meter is not None:
            self.meter.push(rows_bytes(sparse) if sparse else 0)
        if self.error is not None or self._bad_grad(grad, replica):  # nan_guard: apply nothing more
            self._tcond.notify_all()
            return None
        decision = self.sync.push(replica, version)
        if isinstance(decision, Drop):
            return decision
        first, self._first = self._first, None
        if decision.count == 1:  # the step's (or the token update's) first gradient
            if borrow:
                self._first = grad
            else:
                self.acc.copy_(grad)
            self.tables.clear()
        elif first is not None:
            torch.add(first, grad, out=self.acc)
        else:
            self.acc.add_(grad)
        self.tables.add(sparse)
        if isinstance(decision, Apply):
            # The optimizer reads the gradient only inside step(), so the accumulator is reused
            # and refilled next step (no fresh buffer per step).
            self._apply(self._summed(), 1.0 / decision.count)
        return decision

    def _summed(self) -> torch.Tensor:
        """The step's gradient sum: ``acc``, or a lone borrowed gradient (applied with scale 1,
        which the optimizers never write to)."""
        first, self._first = self._first, None
        return first if first is not None else self.acc

    def _own_first(self, grad: torch.Tensor) -> None:
        """A push leaving before its step's apply: its borrowed gradient is copied into ``acc``."""
        if self._first is grad:
            self.acc.copy_(grad)
            self._first = None

    def _applied(self, version: int) -> bool:
        return self.sync.step > version or self.stop or self.error is not None

    async def push_sync(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                        samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                        sparse: Sparse | None = None, attempt: int | None = None) -> Reply:
        """Sync mode: accumulate for the current step; the quorum's last gradient applies the mean
        (of the dense gradients, and of the row gradients: summed per id, divided by the count).
        ``attempt``: the replica's submission (actor calls; FencedOff when it was replaced)."""
        fence(self.owners, replica, attempt)
        if self.uses_tokens:  # training.sync_tokens: TF's token queue (ps/token_push.py)
            return await self._push_token(grad, replica, version, loss, samples, local_step, out, sparse)
        cond = self._condition()
        while True:
            await self._wait_unheld(version)
            async with cond:
                with self.lock:
                    if self._still_held(version):  # a direct apply paused the shard meanwhile
                        continue
                    if self.stop or self.error is not None or self._bad_ids(sparse, replica):
                        decision = None
                    else:
                        decision = self._sync_accumulate(grad, replica, version, loss, samples, local_step, sparse)
                if not isinstance(decision, (Accumulate, Drop)):
                    cond.notify_all()
                elif isinstance(decision, Accumulate):
                    await self._wait(cond, lambda: self._applied(version),
                                     f"replica {replica} waited for the other replicas' gradients of step {version}")
                with self.lock:
                    return self._sparse_reply(out, sparse)

    def push_sync_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                         loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                         sparse: Sparse | None = None) -> tuple | None:
        """``push_sync`` on the calling (connection) thread, or None where it must run on the event
        loop: a checkpoint hold of its step, a stop or an error (:attr:`direct_sync` is the
        caller's check). ``sparse``: as for ``push_sync`` (the reply then carries the rows)."""
        with self.lock:
            if self._held(version) or self.stop or self.error is not None:
                return None
            if self._bad_ids(sparse, replica):  # (the run's error now: every waiter answers)
                decision = None
                self._tcond.notify_all()
            else:
                decision = self._sync_accumulate(grad, replica, version, loss, samples, local_step, sparse,
                                                 borrow=True)
            if isinstance(decision, Accumulate):
                try:
                    self._wait_thread(version, replica)
                finally:
                    self._own_first(grad)
            reply = self._sparse_reply(out, sparse)
        if self._waiting and not isinstance(decision, (Accumulate, Drop)):
            loop.call_soon_threadsafe(self._wake_waiters)  # the step moved (or an error): loop waiters
        return reply

    def _wait_thread(self, version: int, replica: int) -> None:
        """Sleep on ``_tcond`` (the caller holds ``lock``) until step ``version`` is applied, for
        barrier_timeout_s or longer while a session's grace lasts, like the loop's ``_wait``."""
        t0 = time.monotonic()
        while not self._applied(version):
            self._tcond.wait(self._remaining(t0, f"replica {replica} waited for the other replicas' gradients "
                                                 f"of step {version}"))

    async def excuse(self, replica: int, at_step: int | None, how: str = "excuse") -> int:
        """Sync: lost ``replica`` will not push for step ``at_step`` (``SyncAggregator.excuse``): if the
        gradients in make the quorum, apply their mean (no-op unless still at ``at_step``). ``how``:
        ``retire`` (all its data read, or it left an elastic job; never waits on a checkpoint hold: its
        caller releases it, and under it no gradient is in) or ``rejoin`` (back). Returns the step."""
        if how == "retire" and self.gate is not None:
            self.gate.replica_lost(replica)
        if self.mode != "sync":
            return self.step
        if how == "rejoin":
            with self.lock:
                self.sync.rejoin(replica)
            return self.step
        cond = self._condition()
        while True:
            if how != "retire":
                await self._wait_unheld(at_step)
            async with cond:
                with self.lock:
                    if how != "retire" and self._still_held(at_step):  # a direct apply paused the shard meanwhile
                        continue
                    if (self.sync.step != at_step and how != "retire") or self.stop or self.error is not None:
                        return self.step
                    decision = self.sync.retire(replica) if how == "retire" else self.sync.excuse(replica)
                    if isinstance(decision, Apply):
                        self._apply(self._summed(), 1.0 / decision.count)
                if isinstance(decision, Apply):
                    cond.notify_all()
                return self.step

    async def apply_mean(self, grad_sum: torch.Tensor, count: int, version: int, loss: float | None = None,
                         samples: int = 0) -> int:
        """In-graph replication: apply ``grad_sum / count`` — the sum of ``count`` replicas'
        gradients, all computed on this shard's parameters of step ``version`` and reduced by the
        step's graph — as one sync step. Returns the shard's step afterwards (unchanged when the
        update was refused: stopped, failed, a non-finite gradient, or ``version`` not the current
        step). ``grad_sum`` may be scaled in place. ``loss`` is the replicas' mean loss and
        ``samples`` their total, both recorded as one report (replica 0's) on shard 0. Waits
        while a checkpoint snapshot holds the shard, like a push."""
        cond = self._condition()
        while True:
            await self._wait_unheld(version)
            async with cond:
                with self.lock:
                    if self._still_held(version):
                        continue
                    if self.stop or self.error is not None:
                        return self.step
                    self._observe(0, loss, samples, version + 1)
                    applied = False
                    if self.error is None and not self._bad_grad(grad_sum, 0):
                        applied = isinstance(self.sync.push_aggregated(version, count), Apply)
                        if applied:
                            self._apply(grad_sum, 1.0 / count)
                    else:
                        self._tcond.notify_all()
                if applied or self.error is not None:
                    cond.notify_all()
                return self.step
