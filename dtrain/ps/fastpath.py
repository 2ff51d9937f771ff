"""The ps shard's direct push: an async push applied on the data plane's connection thread.

Every other request runs on the ps's event loop (``ParameterShard``'s ``async`` methods): the
connection thread hands it over and waits. For a plain async push that hop — waking the Dask
worker's loop, a future, a thread switch each way — cost more of the ps's CPU than the apply and
the snapshot together. ``push_direct`` instead applies such a push on the connection thread
itself, under the shard's ``lock``:

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
  direct apply through ``loop.call_soon_threadsafe``, only when one is waiting (``_waiting``).

Sync pushes have their own direct path, with the barrier on a ``threading.Condition``
(ps/sync_push.py); the token queue, excuses and holds stay on the event loop.
No Dask here (the loop is the one the data-plane server was given).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch


class DirectPush:
    """Mixin of ``ParameterShard``: :meth:`push_direct` (see the module docstring)."""

    lock: threading.Lock
    _waiting: int
    mode: str
    gate: Any
    tables: Any  # ShardTables (ps/sparse.py)
    stop: bool
    error: str | None
    _held: Any
    _push_async: Any
    _bad_ids: Any
    _sparse_reply: Any
    _wake: Any

    @property
    def direct_pushes(self) -> bool:
        """Whether async pushes may be applied on the connection thread (the static conditions)."""
        return self.mode == "async" and self.gate is None

    def push_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                    loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                    sparse: Any = None) -> tuple | None:
        """``push_pull`` on the calling (connection) thread, or None where it must run on the
        event loop: a checkpoint hold, a stop or an error (:attr:`direct_pushes` is the caller's
        check). The same steps as ``push_pull``'s (``_push_async``), its sparse block included."""
        with self.lock:
            if self._held(None) or self.stop or self.error is not None:
                return None
            if not self._bad_ids(sparse, replica):
                self._push_async(grad, replica, version, loss, samples, local_step, sparse)
            reply = self._sparse_reply(out, sparse)
        if self._waiting:  # (read after the step moved: a waiter counted itself before its check)
            loop.call_soon_threadsafe(self._wake_waiters)
        return reply

    def _wake_waiters(self) -> None:
        """On the event loop: let every waiter re-check its condition (the step moved)."""
        task = asyncio.ensure_future(self._wake())
        _WAKERS.add(task)  # (the loop keeps only a weak reference to a task)
        task.add_done_callback(_WAKERS.discard)


_WAKERS: set[asyncio.Future] = set()
