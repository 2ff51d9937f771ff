"""ShardWaits on its own (ps/waits.py): the lock, the two conditions, the barrier timeout and the
session's grace, the count of the loop's waiters, and the wake-ups of both kinds of waiter."""

from __future__ import annotations

import asyncio
import time

import pytest

from dtrain.ps.waits import BarrierTimeout, ShardWaits
from tests.helpers.ps_parts import Sleeper, loop_thread, loop_waiter, thread_loop_waiter


def test_a_wait_ends_at_its_barrier_timeout_naming_what_it_waited_for():
    """Fails if a wait ignores barrier_timeout_s (it would hang) or its error loses what waited."""
    async def main():
        waits = ShardWaits(0.2)
        cond = waits.condition()
        assert waits.condition() is cond  # (else waiters and notifiers would use different conditions)
        t0 = time.monotonic()
        async with cond:
            with pytest.raises(BarrierTimeout, match=r"replica 3 waited for 0 s \(training.barrier_timeout_s: 0\)"):
                await waits.wait(cond, lambda: False, "replica 3 waited")
        return time.monotonic() - t0, waits.waiting

    elapsed, waiting = asyncio.run(main())
    assert 0.15 < elapsed < 5
    assert waiting == 0  # fails if a timed-out wait stays counted (every direct apply would then wake the loop)


def test_the_loops_waits_are_counted_while_they_last():
    """``waiting`` is what a connection thread reads to decide whether to wake the loop: fails if a
    wait is not counted (a direct apply would leave it asleep) or stays counted after it ended."""
    async def main():
        waits = ShardWaits(5.0)
        state = {"go": False}
        task = await loop_waiter(waits, lambda: state["go"])
        during = waits.waiting
        state["go"] = True
        await waits.wake()
        await asyncio.wait_for(task, 2)
        return during, waits.waiting

    assert asyncio.run(main()) == (1, 0)


def test_a_grace_granted_during_a_wait_lets_it_outlast_its_timeout():
    """The session grants a grace while a replica restarts: a wait already under way must see it
    (fails if the deadline is fixed when the wait begins), and a shorter grace granted later must
    not cut a longer one (fails if grant_grace overwrites instead of keeping the later time)."""
    async def main():
        waits = ShardWaits(0.2)
        state = {"go": False}
        task = await loop_waiter(waits, lambda: state["go"])
        waits.grant_grace(5.0)
        until = waits.grace_until
        waits.grant_grace(0.0)
        assert waits.grace_until == until
        await asyncio.sleep(0.5)  # past the barrier timeout
        assert not task.done()
        state["go"] = True
        await waits.wake()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())


def test_wake_wakes_the_connection_threads_and_the_loops_waiters():
    """A stop, a hold or a release calls wake: fails if it misses either kind of waiter (a direct
    sync push on ``tcond``, a loop waiter on the condition), which would sleep to its timeout."""
    waits = ShardWaits(5.0)
    sleeper = Sleeper(waits).start_sleeping()

    async def main():
        state = {"go": False}
        task = await loop_waiter(waits, lambda: state["go"])
        state["go"] = True
        await waits.wake()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())
    sleeper.join(5)
    assert sleeper.notified is True


def test_wake_soon_wakes_the_loops_waiters_from_another_thread():
    """A connection thread moved the step: wake_soon has the loop itself notify its condition
    (fails if it notifies from the calling thread, or not at all: the waiter times out)."""
    waits = ShardWaits(5.0)
    state = {"go": False}
    with loop_thread() as loop:
        done = thread_loop_waiter(loop, waits, lambda: state["go"], "the waiter")
        state["go"] = True
        waits.wake_soon(loop)
        done.result(timeout=2)
