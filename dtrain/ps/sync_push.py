"""The ps shard's sync barrier: SyncReplicasOptimizer's push, on the event loop or on the data
plane's connection thread (``SyncBarrier``, a part of ``ParameterShard``; :class:`SyncAggregator`
decides).

A sync push accumulates its gradient for the shard's current step and returns once that step has
been applied: by the quorum's last gradient (it applies the mean), by an ``excuse``/``retire`` of
a lost or finished replica, or by a stop. Two ways in, one body (:meth:`SyncBarrier.accumulate`,
which the token queue's push uses too: ps/token_push.py):

- ``push`` (``ParameterShard.push_sync``) — a coroutine on the ps's event loop: the actor path
  (``transport: dask``), and the data plane's fallback while a checkpoint hold, a stop or an error
  is in force. A waiting push sleeps on the shard's ``asyncio.Condition``.
- ``push_direct`` (``ParameterShard.push_sync_direct``) — on the data plane's connection thread,
  under the shard's ``lock``, with no hop to the event loop (that hop cost more of the ps's CPU
  than the apply: ps/fastpath.py). A waiting push sleeps on ``tcond``, a ``threading.Condition``
  on the same lock, and the push that completes the step sends its reply for it (``respond``).
  Only where nothing but the barrier can make the push wait: no token queue (``sync_tokens``),
  and, checked under the lock, no hold of its step, no stop and no error; else it returns None
  and the connection thread takes the event-loop path.

The step's gradient sum is a :class:`GradientSum` the barrier is given (``ParameterShard`` owns
it: a restore clears it). Both kinds of waiter are woken whichever side moves the step:
``ShardCore.apply`` (always called under ``lock``) notifies ``tcond``; a direct apply schedules
the loop's wake-up when a loop waiter is counted (``ShardWaits.waiting``); ``ShardWaits.wake``
(stop, hold, release, the lease) notifies both. The barrier's timeout and the session's grace
(``barrier_grace``) apply alike on both sides. No Dask here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.dataplane.protocol import ANSWERED

from .control import ShardControl
from .core import ShardCore
from .replication import Accumulate, Apply, Decision, Drop
from .sparse import Reply, Sparse, rows_bytes
from .tokens import TokenSync
from .waits import ShardWaits

logger = logging.getLogger(__name__)


class FencedOff(RuntimeError):
    """A push from a submission (attempt) of a replica that the session has since replaced."""


def fence(owners: dict[int, int], replica: int, attempt: int | None) -> None:
    """Refuse a push of ``replica``'s ``attempt`` when another attempt owns that replica
    (``ParameterShard.set_owner``); ``attempt`` None: a caller that does not say (no fencing)."""
    owner = owners.get(replica)
    if attempt is not None and owner is not None and owner != attempt:
        raise FencedOff(f"replica {replica}'s attempt {attempt} is fenced off: attempt {owner} owns that replica "
                        "now (a replaced replica came back)")


class GradientSum:
    """A sync step's gradient sum: ``acc`` (a buffer of the parameters' size, refilled every step;
    empty in async mode), or the step's first gradient read where it lies (``first``, borrowed)."""

    def __init__(self, param: torch.Tensor, sync: bool):
        """A sum for ``param``'s steps; ``sync`` False (async mode: each push is applied alone): no buffer."""
        self.acc = torch.zeros_like(param) if sync else torch.zeros(0)
        self.first: torch.Tensor | None = None

    def add(self, grad: torch.Tensor, count: int, borrow: bool = False) -> None:
        """The step's ``count``-th gradient in. ``borrow``: a first gradient is kept where it lies
        (its pusher waits for the apply before it writes that buffer again); the second is added
        to it into ``acc`` in one pass. Else it is copied (or added) into ``acc``."""
        first, self.first = self.first, None
        if count == 1:  # the step's (or the token update's) first gradient
            if borrow:
                self.first = grad
            else:
                self.acc.copy_(grad)
        elif first is not None:
            torch.add(first, grad, out=self.acc)
        else:
            self.acc.add_(grad)

    def summed(self) -> torch.Tensor:
        """The step's gradient sum: ``acc``, or a lone borrowed gradient (applied with scale 1,
        which the optimizers never write to)."""
        first, self.first = self.first, None
        return first if first is not None else self.acc

    def own_first(self, grad: torch.Tensor) -> None:
        """A push leaving before its step's apply: its borrowed gradient is copied into ``acc``."""
        if self.first is grad:
            self.acc.copy_(grad)
            self.first = None

    def reset(self) -> None:
        """Forget the step's gradients (a restore)."""
        self.acc.zero_()
        self.first = None


class _Waiter:
    """A direct sync push waiting for its step, with what its reply needs (:meth:`SyncBarrier.push_direct`)."""

    __slots__ = ("version", "out", "sparse", "respond", "answered")

    def __init__(self, version: int, out: torch.Tensor, sparse: Sparse | None,
                 respond: Callable[[tuple], None] | None):
        self.version, self.out, self.sparse, self.respond = version, out, sparse, respond
        self.answered = False


class SyncBarrier:
    """``push`` and ``push_direct`` (``push_sync`` and ``push_sync_direct``), ``excuse`` and
    ``apply_mean`` (see the module docstring)."""

    def __init__(self, core: ShardCore, waits: ShardWaits, control: ShardControl, gradients: GradientSum):
        """``control``: the holds a push obeys; ``gradients``: the step's sum."""
        self.core = core
        self.waits = waits
        self.control = control
        self.gradients = gradients
        self.waiters: list[_Waiter] = []  # direct pushes waiting for their step, with a respond

    @property
    def direct(self) -> bool:
        """Whether sync pushes may run on the connection thread (the static conditions)."""
        return self.core.mode == "sync" and not isinstance(self.core.sync, TokenSync)

    def accumulate(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                   local_step: int, sparse: Sparse | None, borrow: bool = False) -> Decision | None:
        """The push's bookkeeping, then its gradient into the step's sum, applying the mean when it
        completes the quorum (the caller holds ``lock``). None: refused (an error, or a non-finite
        gradient under nan_guard), nothing more will be applied.

        ``borrow`` (a direct push: its connection thread waits here for the step's apply before it
        reads anything more into that gradient): a step's first gradient is read where it lies
        (``GradientSum.add``); a lone one is applied from where it lies. A push that leaves before
        the apply (its wait timed out) first copies it in (``GradientSum.own_first``). The loop's
        pushes copy: a connection thread that gives up on one cancels it, and reads on, before the
        loop runs it."""
        core = self.core
        core.observe(replica, loss, samples, local_step)
        if core.meter is not None:
            core.meter.push(rows_bytes(sparse) if sparse else 0)
        if core.error is not None or core.bad_grad(grad, replica):  # nan_guard: apply nothing more
            self.waits.tcond.notify_all()
            return None
        decision = core.sync.push(replica, version)
        if isinstance(decision, Drop):
            return decision
        self.gradients.add(grad, decision.count, borrow)
        if decision.count == 1:
            core.tables.clear()
        core.tables.add(sparse)
        if isinstance(decision, Apply):
            # The optimizer reads the gradient only inside step(), so the accumulator is reused
            # and refilled next step (no fresh buffer per step).
            core.apply(self.gradients.summed(), 1.0 / decision.count)
        return decision

    def applied(self, version: int) -> bool:
        """Whether a push of step ``version`` may leave: the step was applied, or a stop or an error."""
        return self.core.sync.step > version or self.core.stop or self.core.error is not None

    async def push(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                   samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                   sparse: Sparse | None = None) -> Reply:
        """Sync mode: accumulate for the current step; the quorum's last gradient applies the mean
        (of the dense gradients, and of the row gradients: summed per id, divided by the count)."""
        core, waits, control = self.core, self.waits, self.control
        cond = waits.condition()
        while True:
            await control.wait_unheld(version)
            async with cond:
                with waits.lock:
                    if control.still_held(version):  # a direct apply paused the shard meanwhile
                        continue
                    if core.stop or core.error is not None or core.bad_ids(sparse, replica):
                        decision = None
                    else:
                        decision = self.accumulate(grad, replica, version, loss, samples, local_step, sparse)
                if not isinstance(decision, (Accumulate, Drop)):
                    cond.notify_all()
                elif isinstance(decision, Accumulate):
                    await waits.wait(cond, lambda: self.applied(version),
                                     f"replica {replica} waited for the other replicas' gradients of step {version}")
                with waits.lock:
                    return core.sparse_reply(out, sparse)

    def push_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                    loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                    sparse: Sparse | None = None, respond: Callable[[tuple], None] | None = None) -> Any:
        """:meth:`push` on the calling (connection) thread, or None where it must run on the event
        loop: a checkpoint hold of its step, a stop or an error (:attr:`direct` is the caller's
        check). ``sparse``: as for :meth:`push` (the reply then carries the rows).

        ``respond`` (the server's: sends this push's reply on its connection): a push that waits
        for its step leaves it here, and the push that completes the step makes every such
        waiter's reply right after the apply and sends it once it has let go of the lock; the
        waiter's thread, woken, finds itself answered and returns ``ANSWERED`` (nothing to send).
        A replica's reply thus leaves with the step instead of after its connection thread has
        woken and taken the lock and the GIL again, which on a busy machine costs a scheduling
        round per waiter on every step."""
        core, waits = self.core, self.waits
        others: list[tuple[_Waiter, tuple]] = []
        with waits.lock:
            if self.control.held(version) or core.stop or core.error is not None:
                return None
            if core.bad_ids(sparse, replica):  # (the run's error now: every waiter answers)
                decision = None
                waits.tcond.notify_all()
            else:
                decision = self.accumulate(grad, replica, version, loss, samples, local_step, sparse, borrow=True)
            if isinstance(decision, Accumulate):
                waiter = _Waiter(version, out, sparse, respond)
                if respond is not None:
                    self.waiters.append(waiter)
                try:
                    self._wait_thread(version, replica, waiter)
                finally:
                    self.gradients.own_first(grad)
                    if waiter in self.waiters:
                        self.waiters.remove(waiter)
                if waiter.answered:
                    return ANSWERED
            elif isinstance(decision, Apply) and self.waiters:
                others = self._answers(version)
            reply = core.sparse_reply(out, sparse)
        for waiter, answer in others:  # (outside the lock: sends; each waiter's thread stays away from its socket)
            try:
                assert waiter.respond is not None  # (only waiters with a respond are listed)
                waiter.respond(answer)
            except Exception as exc:  # its replica's connection broke: that replica's own thread sees it
                logger.warning("ps: a sync reply could not be sent for a waiting push: %s", exc)
        if waits.waiting and not isinstance(decision, (Accumulate, Drop)):
            waits.wake_soon(loop)  # the step moved (or an error): loop waiters
        return reply

    def _answers(self, version: int) -> list[tuple[_Waiter, tuple]]:
        """The replies of the direct pushes waiting for step ``version``, just applied (the caller
        holds ``lock``): each marked answered and taken off the list, its reply as it would have
        made it after waking."""
        ready = [w for w in self.waiters if w.version == version]
        out = []
        for w in ready:
            self.waiters.remove(w)
            w.answered = True
            out.append((w, self.core.sparse_reply(w.out, w.sparse)))
        return out

    def _wait_thread(self, version: int, replica: int, waiter: _Waiter | None = None) -> None:
        """Sleep on ``tcond`` (the caller holds ``lock``) until step ``version`` is applied (or
        ``waiter`` answered), for barrier_timeout_s or longer while a session's grace lasts, like
        the loop's waits."""
        t0 = time.monotonic()
        while not self.applied(version) and not (waiter is not None and waiter.answered):
            self.waits.tcond.wait(self.waits.remaining(t0, f"replica {replica} waited for the other replicas' "
                                                           f"gradients of step {version}"))

    async def excuse(self, replica: int, at_step: int | None, how: str = "excuse") -> int:
        """Sync: lost ``replica`` will not push for step ``at_step`` (``SyncAggregator.excuse``): if the
        gradients in make the quorum, apply their mean (no-op unless still at ``at_step``). ``how``:
        ``retire`` (all its data read, or it left an elastic job; never waits on a checkpoint hold: its
        caller releases it, and under it no gradient is in) or ``rejoin`` (back). Returns the step."""
        core, waits, control = self.core, self.waits, self.control
        if how == "retire" and core.gate is not None:
            core.gate.replica_lost(replica)
        if core.mode != "sync":
            return core.step
        if how == "rejoin":
            with waits.lock:
                core.sync.rejoin(replica)
            return core.step
        cond = waits.condition()
        while True:
            if how != "retire":
                await control.wait_unheld(at_step)
            async with cond:
                with waits.lock:
                    if how != "retire" and control.still_held(at_step):  # a direct apply paused the shard meanwhile
                        continue
                    if (core.sync.step != at_step and how != "retire") or core.stop or core.error is not None:
                        return core.step
                    decision = core.sync.retire(replica) if how == "retire" else core.sync.excuse(replica)
                    if isinstance(decision, Apply):
                        core.apply(self.gradients.summed(), 1.0 / decision.count)
                if isinstance(decision, Apply):
                    cond.notify_all()
                return core.step

    async def apply_mean(self, grad_sum: torch.Tensor, count: int, version: int, loss: float | None = None,
                         samples: int = 0) -> int:
        """In-graph replication: apply ``grad_sum / count`` — the sum of ``count`` replicas'
        gradients, all computed on this shard's parameters of step ``version`` and reduced by the
        step's graph — as one sync step. Returns the shard's step afterwards (unchanged when the
        update was refused: stopped, failed, a non-finite gradient, or ``version`` not the current
        step). ``grad_sum`` may be scaled in place. ``loss`` is the replicas' mean loss and
        ``samples`` their total, both recorded as one report (replica 0's) on shard 0. Waits
        while a checkpoint snapshot holds the shard, like a push."""
        core, waits, control = self.core, self.waits, self.control
        cond = waits.condition()
        while True:
            await control.wait_unheld(version)
            async with cond:
                with waits.lock:
                    if control.still_held(version):
                        continue
                    if core.stop or core.error is not None:
                        return core.step
                    core.observe(0, loss, samples, version + 1)
                    applied = False
                    if core.error is None and not core.bad_grad(grad_sum, 0):
                        applied = isinstance(core.sync.push_aggregated(version, count), Apply)
                        if applied:
                            core.apply(grad_sum, 1.0 / count)
                    else:
                        waits.tcond.notify_all()
                if applied or core.error is not None:
                    cond.notify_all()
                return core.step
