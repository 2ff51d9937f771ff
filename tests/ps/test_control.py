"""ShardControl on its own (ps/control.py), on a ShardCore and ShardWaits of its own: which pushes
a hold stops, holds and releases, wait_held, the stops (stop_at, request_stop) and the lease."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.ps_parts import Sleeper, advance, control_of


@pytest.mark.parametrize(("hold_at", "version", "held"), [
    (None, None, False), (None, 0, False),
    (2, None, False), (2, 3, False),  # the shard has not reached the hold step yet (it is at step 1)
    (1, None, True), (1, 1, True), (1, 2, True),  # at the hold step: pushes of it and later wait
    (1, 0, False),  # a straggler of the step before still completes its step (sync)
])
def test_which_pushes_a_hold_stops(hold_at, version, held):
    """Fails if a hold stops pushes before the shard reaches its step (the snapshot's step would
    never come), lets a push of the held step in (it would apply during the snapshot), or holds a
    sync push of the step before (the step the snapshot waits for would never complete)."""
    core, _, control = control_of("sync")
    advance(core)
    core.hold_at = hold_at
    assert control.held(version) is held
    assert control.still_held(version) is held


def test_a_stop_or_an_error_ends_a_hold_for_the_pushes():
    """Fails if still_held ignores the stop or the error: a held push woken by them would go back
    to waiting (and spin) instead of answering at once."""
    core, _, control = control_of("sync")
    core.hold_at = 0
    assert control.still_held(None)
    core.stop = True
    assert control.held(None) and not control.still_held(None)
    core.stop, core.error = False, "failed"
    assert not control.still_held(None)


def test_a_held_push_waits_for_the_release():
    """Fails if wait_unheld lets a held push through, or if release does not wake it (it would
    sleep to its barrier timeout)."""
    async def main():
        core, _, control = control_of("sync")
        assert await control.hold() == 0 and core.hold_at == 0
        waiter = asyncio.create_task(control.wait_unheld(0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert await control.release() == 0 and core.hold_at is None
        await asyncio.wait_for(waiter, 2)

    asyncio.run(main())


def test_a_held_push_answers_once_the_run_fails():
    """Fails if wait_unheld keeps waiting through an error (the push would time out instead of
    telling its replica)."""
    async def main():
        core, waits, control = control_of("sync")
        await control.hold()
        waiter = asyncio.create_task(control.wait_unheld(0))
        await asyncio.sleep(0.05)
        core.error = "failed"
        await waits.wake()
        await asyncio.wait_for(waiter, 2)

    asyncio.run(main())


def test_wait_held_returns_once_the_shard_reaches_the_hold_step():
    """Fails if wait_held returns before the shard reaches the hold step (the chief would snapshot a
    step too early), or does not return at once when it is already there."""
    async def main():
        core, waits, control = control_of("sync")
        assert await control.hold(at_step=1) == 0
        waiting = asyncio.create_task(control.wait_held())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        advance(core)
        await waits.wake()
        assert await asyncio.wait_for(waiting, 2) == 1
        assert await asyncio.wait_for(control.wait_held(), 0.5) == 1

    asyncio.run(main())


def test_stop_at_lowers_the_last_step_and_stops_a_shard_already_past_it():
    """Fails if stop_at raises the last step (min), leaves shard 0 running when it is already at or
    past the new end, or stops a shard that does not count the global step (shard 0's stop is the
    run's)."""
    async def main():
        core, _, control = control_of("async")
        for _ in range(3):
            advance(core)
        assert await control.stop_at(5) == 3 and core.steps == 5 and not core.stop
        await control.stop_at(10)
        assert core.steps == 5
        await control.stop_at(2)
        assert core.steps == 2 and core.stop
        other, _, other_control = control_of("async", index=1)
        await other_control.stop_at(0)
        assert other.steps == 0 and not other.stop

    asyncio.run(main())


def test_a_stop_wakes_the_held_pushes_and_the_connection_threads():
    """Fails if stop_at or request_stop do not wake the waiters: a held push on the loop and a
    direct sync push on ``tcond`` would each sleep to their timeout."""
    async def main():
        _, waits, control = control_of("async")
        await control.hold()
        held = asyncio.create_task(control.wait_unheld())
        await asyncio.sleep(0.05)
        assert await control.stop_at(0) == 0
        await asyncio.wait_for(held, 2)
        sleeper = Sleeper(waits).start_sleeping()
        await control.request_stop()
        await asyncio.to_thread(sleeper.join, 5)
        return sleeper.notified

    assert asyncio.run(main()) is True


class Plane:
    """A data plane as the lease sees it: something to close."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_lapsed_lease_stops_the_shard_and_closes_its_data_plane():
    """Fails if renew does not push the expiry out (a renewing chief's shards would stop), if a
    lapsed lease does not stop the shard, name the lease and close the data plane, or if a renewal
    after the lapse succeeds (the chief would believe a stopped shard alive)."""
    async def main():
        core, _, control = control_of("sync", lease_s=0.5)
        control.data_plane = plane = Plane()
        assert await control.renew() == 0
        await asyncio.sleep(0.3)
        await control.renew()
        await asyncio.sleep(0.3)  # 0.6 s after the first renewal, 0.3 s after the second
        assert not core.stop and not plane.closed
        await asyncio.sleep(0.6)
        assert core.stop and plane.closed
        assert core.error is not None and "no word from the chief for 0.5 s" in core.error
        with pytest.raises(RuntimeError, match="no word from the chief"):
            await control.renew()

    asyncio.run(main())


def test_without_a_lease_renew_arms_nothing():
    """Fails if a shard without ``lease_s`` expires (a chief that does not lease would lose it)."""
    async def main():
        core, _, control = control_of("sync")
        assert await control.renew() == 0
        await asyncio.sleep(0.05)
        return core.stop, core.error

    assert asyncio.run(main()) == (False, None)
