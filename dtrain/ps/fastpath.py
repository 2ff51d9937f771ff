"""The ps shard's async push, and its fast path: a push applied on the data plane's connection thread.

``AsyncPush`` is a part of ``ParameterShard``: ``push_pull`` on the event loop (the actor path,
the staleness gate's waits) and ``push_direct`` on a connection thread, one body
(:meth:`AsyncPush.apply`: the push's bookkeeping, then its apply unless it is too stale or bad).

Every other request runs on the ps's event loop (``ParameterShard``'s ``async`` methods): the
connection thread hands it over and waits. For a plain async push that hop — waking the Dask
worker's loop, a future, a thread switch each way — cost more of the ps's CPU than the apply and
the snapshot together. ``push_direct`` instead applies such a push on the connection thread
itself, under the shard's ``lock`` (ps/waits.py):

- Only where nothing can make the push wait: ``training.mode: async`` and no staleness gate
  (``max_staleness`` on the shard that counts the global step). Under the lock the push also
  needs no checkpoint hold, no stop and no error; else it returns None and the connection thread
  takes the event-loop path, which waits or replies exactly as before. A request's sparse block
  (table rows' gradients, the next batch's ids) is applied and answered under the same lock.
- The lock covers the check, the apply (optimizer, moving averages, records, the meter, the step's
  own checkpoint hold or stop, the table rows) and the reply's snapshot. The event-loop methods that
  read or write the same state (the slow push, ``pull``, ``get_params``, ``get_state``,
  ``set_state``, ``stats``, ``load``, ``hold``, ``release``, ``stop_at``, ``gather_rows``,
  ``read_part``) take it around their
  (short, never awaiting) critical sections, so a direct apply never lands between a hold and
  its snapshot, and never inside a checkpoint's read.
- Waiters on the event loop (a ``pull(min_step)``, a chief's ``wait_held``) are woken after a
  direct apply through ``loop.call_soon_threadsafe`` (``ShardWaits.wake_soon``), only when one is
  waiting (``ShardWaits.waiting``).

Sync pushes have their own direct path, with the barrier on a ``threading.Condition``
(ps/sync_push.py); the token queue, excuses and holds stay on the event loop.
No Dask here (the loop is the one the data-plane server was given).
"""

from __future__ import annotations

import asyncio

import torch

from .control import ShardControl
from .core import ShardCore
from .replication import Apply
from .sparse import Reply, Sparse, rows_bytes
from .waits import ShardWaits


class AsyncPush:
    """``push_pull`` and :meth:`push_direct` (see the module docstring)."""

    def __init__(self, core: ShardCore, waits: ShardWaits, control: ShardControl):
        """``control``: the holds a push obeys."""
        self.core = core
        self.waits = waits
        self.control = control

    @property
    def direct(self) -> bool:
        """Whether async pushes may be applied on the connection thread (the static conditions)."""
        return self.core.mode == "async" and self.core.gate is None

    def apply(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
              local_step: int, sparse: Sparse | None = None) -> None:
        """An async push's bookkeeping, then its apply unless it is too stale or bad (the caller
        holds ``lock``: :meth:`push_pull` on the event loop, :meth:`push_direct` on a connection thread)."""
        core = self.core
        core.observe(replica, loss, samples, local_step)
        if core.meter is not None:
            core.meter.push(rows_bytes(sparse) if sparse else 0, core.step - version, loss)
        if core.error is None and not core.bad_grad(grad, replica) and isinstance(core.policy.push(version), Apply):
            core.tables.add(sparse)
            core.apply(grad)

    async def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                        samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                        sparse: Sparse | None = None) -> Reply:
        """Async mode: apply this gradient now (unless too stale), reply with fresh parameters."""
        core, waits, control = self.core, self.waits, self.control
        while True:
            await control.wait_unheld()
            with waits.lock:
                if control.still_held(None):  # a direct push's step paused the shard meanwhile
                    continue
                if core.stop or core.error is not None or core.bad_ids(sparse, replica):
                    return core.sparse_reply(out, sparse)
                self.apply(grad, replica, version, loss, samples, local_step, sparse)
                if core.gate is None:
                    return core.sparse_reply(out, sparse)
                break
        gate = core.gate
        if gate is not None:  # (no direct pushes with a gate: no lock below)
            gate.report(replica, local_step)
            cond = waits.condition()
            async with cond:
                cond.notify_all()
                if not gate.may_proceed(replica, local_step + 1):
                    await waits.wait(cond, lambda: core.stop or gate.may_proceed(replica, local_step + 1),
                                     f"replica {replica} waited for slower replicas (max_staleness "
                                     f"{gate.max_staleness})")
        return core.sparse_reply(out, sparse)

    def push_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                    loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                    sparse: Sparse | None = None) -> tuple | None:
        """:meth:`push_pull` on the calling (connection) thread, or None where it must run on the
        event loop: a checkpoint hold, a stop or an error (:attr:`direct` is the caller's check).
        The same steps as ``push_pull``'s (:meth:`apply`), its sparse block included."""
        core, waits = self.core, self.waits
        with waits.lock:
            if self.control.held(None) or core.stop or core.error is not None:
                return None
            if not core.bad_ids(sparse, replica):
                self.apply(grad, replica, version, loss, samples, local_step, sparse)
            reply = core.sparse_reply(out, sparse)
        if waits.waiting:  # (read after the step moved: a waiter counted itself before its check)
            waits.wake_soon(loop)
        return reply
