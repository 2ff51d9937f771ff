"""A ps shard's parts built by hand, without ``ParameterShard`` (tests/ps/test_core.py,
test_control.py, test_sync_push.py, test_fastpath.py, test_token_push.py): real torch, no Dask."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dtrain.ps.control import ShardControl
from dtrain.ps.core import ShardCore
from dtrain.ps.waits import ShardWaits
from tests.helpers.waiting import wait_until


def core_of(mode: str = "sync", n: int = 4, replicas: int = 1, barrier_s: float = 5.0,
            **config: Any) -> tuple[ShardCore, ShardWaits]:
    """A shard's state (``n`` zeros, sgd at lr 1, shard 0 unless ``index``) and its waits."""
    waits = ShardWaits(barrier_s)
    cfg = {"index": 0, "mode": mode, "steps": 100, "num_replicas": replicas,
           "optimizer": {"name": "sgd", "lr": 1.0}, **config}
    return ShardCore(cfg, torch.zeros(n), waits), waits


def control_of(mode: str = "sync", lease_s: float | None = None, **config: Any
               ) -> tuple[ShardCore, ShardWaits, ShardControl]:
    core, waits = core_of(mode, **config)
    return core, waits, ShardControl(core, waits, lease_s)


def advance(core: ShardCore) -> int:
    """One step applied (a zero gradient, one replica's), under the lock: the new step."""
    with core.waits.lock:
        if core.mode == "sync":
            core.sync.push(0, core.step)
        else:
            core.policy.push(core.step)
        core.apply(torch.zeros_like(core.param))
    return core.step


@contextlib.contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on its own thread (as a ps worker's, beside its connection threads)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def loop_waiter(waits: ShardWaits, ready: Callable[[], bool], what: str = "w") -> asyncio.Task[None]:
    """A waiter on the shard's loop condition until ``ready()`` (as a held push or a pull waits),
    started on the running loop and given time to fall asleep."""
    cond = waits.condition()

    async def wait() -> None:
        async with cond:
            await waits.wait(cond, ready, what)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.05)
    return task


def thread_loop_waiter(loop: asyncio.AbstractEventLoop, waits: ShardWaits, ready: Callable[[], bool], what: str,
                       then: Callable[[], Any] = lambda: None) -> concurrent.futures.Future[Any]:
    """The same waiter on ``loop``, running on its own thread (:func:`loop_thread`), once it is
    counted in ``waits.waiting``; its result is ``then()``, read on the loop as the wait ends."""
    async def wait() -> Any:
        cond = waits.condition()
        async with cond:
            await waits.wait(cond, ready, what)
        return then()

    future = asyncio.run_coroutine_threadsafe(wait(), loop)
    wait_until(lambda: waits.waiting == 1, 10, f"{what}: counted as waiting", every=0.005)
    return future


class Sleeper(threading.Thread):
    """A connection thread sleeping once on ``tcond`` (as a direct sync push waits for its step):
    ``notified`` says whether a notify woke it (else its ``timeout`` ran out)."""

    def __init__(self, waits: ShardWaits, timeout: float = 10.0):
        super().__init__(daemon=True)
        self.waits, self.timeout = waits, timeout
        self.notified: bool | None = None
        self._waiting = threading.Event()

    def run(self) -> None:
        with self.waits.lock:
            self._waiting.set()
            self.notified = self.waits.tcond.wait(self.timeout)

    def start_sleeping(self) -> Sleeper:
        """Start, and return once it sleeps on ``tcond`` (it released the lock to do so)."""
        self.start()
        assert self._waiting.wait(10)
        with self.waits.lock:  # (free only once the thread waits on tcond)
            pass
        return self


def refusing_states(core: ShardCore) -> Iterator[str]:
    """Puts ``core`` in each state in which a direct push must go to the event loop instead (a
    checkpoint hold of step 0, a stop, an error), one at a time, the others cleared; yields its name."""
    for name, value in (("hold_at", 0), ("stop", True), ("error", "failed")):
        core.hold_at, core.stop, core.error = None, False, None
        setattr(core, name, value)
        yield name
