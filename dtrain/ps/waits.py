"""A ps shard's waits: its lock, the two conditions its waiting requests sleep on, their timeout.

``ShardWaits`` is a part of ``ParameterShard`` that every other part is given: the shard's
``lock`` (held by a push applied on a data-plane connection thread and by the event-loop methods
around their reads and writes of the same state: ps/fastpath.py), ``tcond`` (a
``threading.Condition`` on that lock, where direct sync pushes wait for their step:
ps/sync_push.py) and the event loop's ``asyncio.Condition`` (created on first use, so that it
binds to the worker's running loop), where the loop's waiters sleep (a sync push at the barrier,
a ``pull(min_step)``, a push held by a checkpoint, a chief's ``wait_held``).

A wait lasts ``barrier_timeout_s``, or longer while a grace the session granted
(``ParameterShard.barrier_grace``: a lost replica is being restarted) runs; then
:class:`BarrierTimeout`. ``waiting`` counts the loop's waits in progress, so that a connection
thread that moved the step schedules the loop's wake-up (:meth:`ShardWaits.wake_soon`) only when
someone is waiting. No torch, no Dask here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable


class BarrierTimeout(RuntimeError):
    """A sync replica waited ``barrier_timeout_s`` for the other replicas' gradients."""


class ShardWaits:
    """The shard's lock and conditions, and how long a wait may last (see the module docstring)."""

    def __init__(self, barrier_timeout_s: float = 60.0):
        self.barrier_timeout_s = barrier_timeout_s
        self.lock = threading.Lock()
        self.tcond = threading.Condition(self.lock)
        self.grace_until = 0.0  # monotonic time until which waits may exceed their timeout
        self.waiting = 0  # waits on the loop's condition in progress
        self._cond: asyncio.Condition | None = None

    def condition(self) -> asyncio.Condition:
        """The event loop's condition (created lazily so it binds to the worker's running loop)."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def wait(self, cond: asyncio.Condition, predicate: Callable[[], bool], what: str) -> None:
        """Wait (holding ``cond``) for ``predicate`` for barrier_timeout_s, or longer while a grace
        granted by the session (:meth:`grant_grace`) has not run out."""
        t0 = time.monotonic()
        self.waiting += 1
        try:
            while True:
                remaining = self.remaining(t0, what)
                try:
                    await asyncio.wait_for(cond.wait_for(predicate), remaining)
                    return
                except (asyncio.TimeoutError, TimeoutError):
                    continue  # a grace may have been granted meanwhile: check again
        finally:
            self.waiting -= 1

    def remaining(self, t0: float, what: str) -> float:
        """Seconds a wait begun at ``t0`` (monotonic) may still last: barrier_timeout_s, or longer
        while a session's grace runs; BarrierTimeout once none are left (the loop's waits and the
        connection threads' alike)."""
        remaining = max(t0 + self.barrier_timeout_s, self.grace_until) - time.monotonic()
        if remaining <= 0:
            raise BarrierTimeout(f"{what} for {time.monotonic() - t0:.0f} s (training.barrier_timeout_s: "
                                 f"{self.barrier_timeout_s:.0f}); a replica is probably lost")
        return remaining

    def grant_grace(self, seconds: float) -> None:
        """Let waits outlast their barrier timeout by ``seconds`` from now."""
        self.grace_until = max(self.grace_until, time.monotonic() + seconds)

    async def wake(self) -> None:
        """Let every waiter re-check its condition (after a stop, a hold or a release, or a step a
        connection thread applied): the connection threads' on ``tcond``, then the loop's."""
        with self.lock:
            self.tcond.notify_all()
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    def wake_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """From a connection thread: have ``loop`` run :meth:`wake` (the step moved under it)."""
        loop.call_soon_threadsafe(self._wake_on_loop)

    def _wake_on_loop(self) -> None:
        task = asyncio.ensure_future(self.wake())
        _WAKERS.add(task)  # (the loop keeps only a weak reference to a task)
        task.add_done_callback(_WAKERS.discard)


_WAKERS: set[asyncio.Future] = set()
