"""A ps shard's control calls from the chief: its lease, stops, and checkpoint holds.

A mixin of ``ParameterShard`` (the state it reads and writes is the shard's: ``step``, ``steps``,
``stop``, ``error``, ``hold_at``, the condition its waiters sleep on). No Dask here: every call
runs on the worker's event loop like the shard's pushes.

A lease keeps a shard only as long as its chief lives (``renew``): a chief that is killed (or
whose machine is lost) stops renewing, and after ``lease_s`` the shard stops its replicas (the
stop flag and an error in every reply) and closes its data plane, so a long-lived worker pool
does not train on, and hold listeners and memory, for a run nobody watches.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("dtrain.ps.shard")


class ShardControl:
    """Lease, stop and hold calls (see the module docstring)."""

    index: int
    steps: int
    stop: bool
    error: str | None
    hold_at: int | None
    holds_global_step: bool
    lease_s: float | None
    _lease: asyncio.TimerHandle | None
    _expiry: asyncio.Task | None
    _cond: asyncio.Condition | None
    step: Any
    _condition: Any
    _wait: Any
    lock: Any  # taken around what a direct push reads or writes (ps/fastpath.py)
    _tcond: Any  # direct sync pushes wait on it (ps/sync_push.py)

    async def renew(self) -> int:
        """The chief is alive: the lease runs ``lease_s`` seconds from now (see the module docstring)."""
        if self._expiry is not None:
            raise RuntimeError(self.error)
        if self.lease_s:
            if self._lease is not None:
                self._lease.cancel()
            self._lease = asyncio.get_running_loop().call_later(self.lease_s, self._expire)
        return self.step

    def _expire(self) -> None:
        """No renewal for ``lease_s``: the chief is gone. Stop the replicas (they read the stop flag
        and the error at their next reply; waiting ones are woken) and free the data plane."""
        self.error = self.error or (f"ps shard {self.index}: no word from the chief for {self.lease_s:g} s "
                                    f"(its lease): stopped, data plane closed")
        self.stop = True
        logger.warning("%s", self.error)
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()  # kept in _server: close_data_plane still reports what it served
        self._expiry = asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        """Let every waiter re-check its condition (after stop, hold or release changed): on the
        loop, and direct sync pushes on connection threads (ps/sync_push.py)."""
        with self.lock:
            self._tcond.notify_all()
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    async def stop_at(self, step: int) -> int:
        """End training at global step ``step`` (a stop_at_step hook), as at ``training.steps``:
        the update of that step is the last one applied."""
        with self.lock:
            self.steps = min(self.steps, int(step))
            stop = self.holds_global_step and self.step >= self.steps
            if stop:
                self.stop = True
        if stop:
            await self._wake()
        return self.step

    async def request_stop(self) -> int:
        """Ask every replica to stop at its next reply; releases waiting replicas."""
        self.stop = True
        await self._wake()
        return self.step

    async def hold(self, at_step: int | None = None) -> int:
        """Pause applies from ``at_step`` on (default: now); returns the current step."""
        with self.lock:  # no direct push lands between this and the snapshot it is for
            self.hold_at = self.step if at_step is None else at_step
        await self._wake()  # a raised hold step may free pushes that were held
        return self.step

    async def wait_held(self) -> int:
        """Return once the shard has reached its hold step (sync: the step the snapshot needs)."""
        if self.hold_at is not None and self.step < self.hold_at:
            cond = self._condition()
            async with cond:
                await self._wait(cond, lambda: self.hold_at is None or self.step >= self.hold_at or self.stop
                                 or self.error is not None, f"shard {self.index} waited for step {self.hold_at}")
        return self.step

    async def release(self) -> int:
        """End a hold: waiting pushes go on."""
        with self.lock:
            self.hold_at = None
        await self._wake()
        return self.step

