"""A ps shard's control calls from the chief: its lease, stops, and checkpoint holds.

``ShardControl`` is a part of ``ParameterShard``, given the shard's state
(:class:`~dtrain.ps.core.ShardCore`: ``step``, ``steps``, ``stop``, ``error``, ``hold_at``) and
its waits (:class:`~dtrain.ps.waits.ShardWaits`: the lock, the conditions its waiters sleep on).
It also answers, for every push, whether a checkpoint hold stops it (:meth:`ShardControl.held`)
and waits one out (:meth:`ShardControl.wait_unheld`). No Dask here: every call runs on the
worker's event loop like the shard's pushes.

A lease keeps a shard only as long as its chief lives (``renew``): a chief that is killed (or
whose machine is lost) stops renewing, and after ``lease_s`` the shard stops its replicas (the
stop flag and an error in every reply) and closes its data plane (``data_plane``, which
``ParameterShard.open_data_plane`` sets), so a long-lived worker pool does not train on, and
hold listeners and memory, for a run nobody watches.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .core import ShardCore
from .waits import ShardWaits

logger = logging.getLogger("dtrain.ps.shard")


class Closable(Protocol):
    def close(self) -> None: ...


class ShardControl:
    """Lease, stop and hold calls, and the holds every push obeys (see the module docstring)."""

    def __init__(self, core: ShardCore, waits: ShardWaits, lease_s: float | None = None):
        """``lease_s``: the chief's lease, armed by the first :meth:`renew`; None: no lease."""
        self.core = core
        self.waits = waits
        self.lease_s = lease_s
        self.data_plane: Closable | None = None  # closed when the lease runs out (kept: it reports what it served)
        self._lease: asyncio.TimerHandle | None = None
        self._expiry: asyncio.Task | None = None

    # ------------------------------------------------------------------ the lease
    async def renew(self) -> int:
        """The chief is alive: the lease runs ``lease_s`` seconds from now (see the module docstring)."""
        if self._expiry is not None:
            raise RuntimeError(self.core.error)
        if self.lease_s:
            if self._lease is not None:
                self._lease.cancel()
            self._lease = asyncio.get_running_loop().call_later(self.lease_s, self._expire)
        return self.core.step

    def _expire(self) -> None:
        """No renewal for ``lease_s``: the chief is gone. Stop the replicas (they read the stop flag
        and the error at their next reply; waiting ones are woken) and free the data plane."""
        core = self.core
        core.error = core.error or (f"ps shard {core.index}: no word from the chief for {self.lease_s:g} s "
                                    f"(its lease): stopped, data plane closed")
        core.stop = True
        logger.warning("%s", core.error)
        if self.data_plane is not None:
            self.data_plane.close()
        self._expiry = asyncio.get_running_loop().create_task(self.waits.wake())

    # ------------------------------------------------------------------ stops
    async def stop_at(self, step: int) -> int:
        """End training at global step ``step`` (a stop_at_step hook), as at ``training.steps``:
        the update of that step is the last one applied."""
        core = self.core
        with self.waits.lock:
            core.steps = min(core.steps, int(step))
            stop = core.holds_global_step and core.step >= core.steps
            if stop:
                core.stop = True
        if stop:
            await self.waits.wake()
        return core.step

    async def request_stop(self) -> int:
        """Ask every replica to stop at its next reply; releases waiting replicas."""
        self.core.stop = True
        await self.waits.wake()
        return self.core.step

    # ------------------------------------------------------------------ checkpoint holds
    async def hold(self, at_step: int | None = None) -> int:
        """Pause applies from ``at_step`` on (default: now); returns the current step."""
        with self.waits.lock:  # no direct push lands between this and the snapshot it is for
            self.core.hold_at = self.core.step if at_step is None else at_step
        await self.waits.wake()  # a raised hold step may free pushes that were held
        return self.core.step

    async def wait_held(self) -> int:
        """Return once the shard has reached its hold step (sync: the step the snapshot needs)."""
        core = self.core
        if core.hold_at is not None and core.step < core.hold_at:
            cond = self.waits.condition()
            async with cond:
                await self.waits.wait(cond, lambda: core.hold_at is None or core.step >= core.hold_at or core.stop
                                      or core.error is not None, f"shard {core.index} waited for step {core.hold_at}")
        return core.step

    async def release(self) -> int:
        """End a hold: waiting pushes go on."""
        with self.waits.lock:
            self.core.hold_at = None
        await self.waits.wake()
        return self.core.step

    def held(self, version: int | None) -> bool:
        """Whether a hold stops a push of ``version`` (None: an async push, held from the hold
        step on): a sync push of an earlier step completes the step being waited for."""
        core = self.core
        if core.hold_at is None or core.step < core.hold_at:
            return False
        return version is None or version >= core.hold_at

    def still_held(self, version: int | None) -> bool:
        """Re-checked under ``lock`` after :meth:`wait_unheld`: held, and not released by a stop or
        an error (which end that wait too: the caller then answers at once, else it would spin)."""
        return self.held(version) and not self.core.stop and self.core.error is None

    async def wait_unheld(self, version: int | None = None) -> None:
        """Pause a push while a snapshot is being taken (applies must not move the parameters)."""
        if not self.held(version):
            return
        core = self.core
        cond = self.waits.condition()
        async with cond:
            await self.waits.wait(cond, lambda: not self.held(version) or core.stop or core.error is not None,
                                  f"a push on shard {core.index} waited for a checkpoint snapshot")
