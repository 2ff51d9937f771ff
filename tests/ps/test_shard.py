"""ParameterShard on its own event loop (as on a ps worker): barriers, their grace, reply buffers."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dtrain.ps.shard import BarrierTimeout, ParameterShard
from tests.helpers.waiting import wait_until


def sync_shard(n: int = 8, barrier_s: float = 0.5) -> ParameterShard:
    config = {"index": 0, "mode": "sync", "steps": 100, "num_replicas": 2, "replicas_to_aggregate": 2,
              "optimizer": {"name": "sgd", "lr": 1.0}, "barrier_timeout_s": barrier_s}
    return ParameterShard(config, torch.zeros(n))


def test_a_lone_sync_push_times_out_at_the_barrier():
    async def main():
        shard = sync_shard()
        t0 = time.monotonic()
        with pytest.raises(BarrierTimeout, match="barrier_timeout_s"):
            await shard.push_sync(torch.ones(8), 0, 0)
        return time.monotonic() - t0

    assert 0.4 < asyncio.run(main()) < 10  # (the default barrier timeout would be 30 s or more)


def test_barrier_grace_lets_a_restarted_replica_arrive_late():
    """The session grants a grace when it restarts a lost replica: the surviving replica's push
    waits past barrier_timeout_s and completes when the replacement pushes."""
    async def main():
        shard = sync_shard(barrier_s=0.3)
        waiting = asyncio.create_task(shard.push_sync(torch.ones(8), 0, 0))
        await asyncio.sleep(0.1)
        await shard.barrier_grace(5.0)
        await asyncio.sleep(0.6)  # twice the barrier timeout
        assert not waiting.done()
        late = await shard.push_sync(torch.full((8,), 3.0), 1, 0)
        early = await waiting
        return early, late

    (p0, s0, *_), (p1, s1, *_) = asyncio.run(main())
    assert s0 == s1 == 1 and torch.equal(p0, p1) and torch.equal(p1, torch.full((8,), -2.0))


def test_replies_go_into_the_callers_buffer_else_a_lazy_ring():
    async def main():
        config = {"index": 0, "mode": "async", "steps": 100, "num_replicas": 2,
                  "optimizer": {"name": "sgd", "lr": 1.0}}
        shard = ParameterShard(config, torch.zeros(4))
        assert shard.core.ring == []  # nothing allocated until an actor-path reply needs it
        out = torch.empty(4)
        params, step, *_ = await shard.push_pull(torch.ones(4), 0, 0, out=out)
        assert params is out and step == 1 and torch.equal(out, -torch.ones(4)) and shard.core.ring == []
        a, *_ = await shard.pull()
        b, *_ = await shard.pull()
        assert a.data_ptr() != b.data_ptr() and len(shard.core.ring) == 2  # snapshots, not the live buffer
        assert a.data_ptr() != shard.param.data_ptr()

    asyncio.run(main())


def test_only_a_sync_shard_holds_a_gradient_accumulator():
    """A sync step sums its replicas' gradients into a shard-sized buffer; async applies every push
    alone, so an async shard holds none (it held one, 1x the parameters of memory, unused). The
    sync sum still comes out right (fails if the buffer went for sync too)."""
    async def main():
        config = {"index": 0, "mode": "async", "steps": 100, "num_replicas": 2,
                  "optimizer": {"name": "sgd", "lr": 1.0}}
        shard = ParameterShard(config, torch.zeros(1000))
        await shard.push_pull(torch.ones(1000), 0, 0, out=torch.empty(1000))
        assert shard.gradients.acc.numel() == 0 and torch.equal(shard.param, -torch.ones(1000))
        sync = sync_shard(n=1000)
        assert sync.gradients.acc.numel() == 1000
        both = await asyncio.gather(sync.push_sync(torch.ones(1000), 0, 0), sync.push_sync(torch.full((1000,), 3.0), 1, 0))
        assert all(step == 1 for _, step, *_ in both) and torch.equal(sync.param, torch.full((1000,), -2.0))

    asyncio.run(main())


def test_excuse_releases_a_replica_waiting_for_a_lost_ones_gradient():
    """The session excuses a lost replica on a shard that is behind the others: the survivor's
    waiting push completes with its own gradient as the step's mean."""
    async def main():
        shard = sync_shard(barrier_s=5.0)
        waiting = asyncio.create_task(shard.push_sync(torch.full((8,), 2.0), 0, 0))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert await shard.excuse(1, at_step=5) == 0  # not this shard's step: no-op
        assert not waiting.done()
        assert await shard.excuse(1, at_step=0) == 1
        params, step, *_ = await asyncio.wait_for(waiting, 2)
        return params, step, shard.core.sync.excused

    params, step, excused = asyncio.run(main())
    assert step == 1 and torch.equal(params, torch.full((8,), -2.0)) and excused == set()


def test_a_timed_out_direct_push_leaves_its_gradient_in_the_step():
    """A direct push's gradient (its connection thread waits for the apply) is read where it lies,
    not copied; a push that gives up at the barrier first copies it into the step's sum, so a
    buffer its replica reuses afterwards does not reach the apply (the step's mean is of what was
    pushed)."""
    shard, loop = sync_shard(barrier_s=0.3), asyncio.new_event_loop()
    grad = torch.full((8,), 2.0)
    with pytest.raises(BarrierTimeout):
        shard.push_sync_direct(loop, grad, 0, 0, None, 0, 0, torch.empty(8))
    grad.fill_(100.0)  # the replica's buffer, reused
    params, step, *_ = shard.push_sync_direct(loop, torch.full((8,), 4.0), 1, 0, None, 0, 0, torch.empty(8))
    assert step == 1 and torch.equal(params, torch.full((8,), -3.0))
    loop.close()


def test_a_direct_sync_step_leaves_its_replicas_gradients_untouched():
    """The borrowed first gradient and the second are summed into the shard's own buffer, and a lone
    borrowed one (the other replica excused) is applied from where it lies: no replica's gradient
    is written."""
    import threading

    shard, loop = sync_shard(barrier_s=5.0), asyncio.new_event_loop()
    g0, g1 = torch.full((8,), 2.0), torch.full((8,), 4.0)
    first = threading.Thread(target=shard.push_sync_direct, args=(loop, g0, 0, 0, None, 0, 0, torch.empty(8)))
    first.start()
    wait_until(lambda: shard.meter.pushes == 1, 30.0, "g0 in", every=0.005)  # g0 is in, borrowed: the step's first gradient
    shard.push_sync_direct(loop, g1, 1, 0, None, 0, 0, torch.empty(8))
    first.join(5)
    assert torch.equal(g0, torch.full((8,), 2.0)) and torch.equal(g1, torch.full((8,), 4.0))
    assert torch.equal(shard.param, torch.full((8,), -3.0))
    lone = threading.Thread(target=shard.push_sync_direct, args=(loop, g0, 0, 1, None, 0, 0, torch.empty(8)))
    lone.start()
    wait_until(lambda: shard.meter.pushes == 3, 30.0, "g0 in again", every=0.005)  # g0 is in again, alone
    assert asyncio.run(shard.excuse(1, at_step=1)) == 2
    lone.join(5)
    assert torch.equal(g0, torch.full((8,), 2.0)) and torch.equal(shard.param, torch.full((8,), -5.0))
    loop.close()


def staleness_shard(k: int, replicas: int = 2) -> ParameterShard:
    config = {"index": 0, "mode": "async", "steps": 1000, "num_replicas": replicas, "max_staleness": k,
              "optimizer": {"name": "sgd", "lr": 1.0}, "barrier_timeout_s": 5}
    return ParameterShard(config, torch.zeros(4))


def test_max_staleness_gate_holds_a_replica_too_far_ahead_until_the_slowest_reports():
    """SSP through the shard itself, k = 2: replica 1 is still at local step 0. Replica 0's push of
    local step 1 returns (its next, step 2, is 2 ahead); its push of local step 2 waits (step 3
    would be 3 ahead) until replica 1 reports local step 1."""
    async def main():
        shard = staleness_shard(k=2)
        g = torch.ones(4)
        await asyncio.wait_for(shard.push_pull(g, 0, shard.step, 0.1, 1, 1), 1)
        blocked = asyncio.create_task(shard.push_pull(g, 0, shard.step, 0.1, 1, 2))
        await asyncio.sleep(0.3)
        assert not blocked.done()
        await shard.push_pull(g, 1, shard.step, 0.1, 1, 1)  # the slow replica reports step 1
        params, step, stop, _ = await asyncio.wait_for(blocked, 2)
        return step

    assert asyncio.run(main()) == 3  # every push was applied (the waiting one before it waited)


def test_max_staleness_drops_a_push_on_parameters_more_than_k_updates_old():
    async def main():
        shard = staleness_shard(k=1, replicas=3)
        g = torch.ones(4)
        # (local step 0 for every replica: the SSP gate lets them all go on)
        await shard.push_pull(g, 0, 0, 0.1, 1, 0)  # step 1
        await shard.push_pull(g, 1, 0, 0.1, 1, 0)  # version 0 is 1 update old: applied, step 2
        before = shard.param.clone()
        params, step, _, _ = await shard.push_pull(g, 2, 0, 0.1, 1, 0)  # 2 updates old: dropped
        return before, params, step, shard.dropped_stale

    before, after, step, dropped = asyncio.run(main())
    assert step == 2 and dropped == 1
    assert torch.equal(before, after) and torch.equal(after, torch.full((4,), -2.0))


def test_a_shard_pauses_at_every_checkpoint_step_until_released():
    """checkpoint.every_steps: the shard holds itself at each multiple, so the chief's snapshot
    lands exactly there however fast the steps go; release() lets the next step in."""
    async def main():
        config = {"index": 0, "mode": "sync", "steps": 100, "num_replicas": 1, "checkpoint_every": 3,
                  "optimizer": {"name": "sgd", "lr": 1.0}, "barrier_timeout_s": 5}
        shard = ParameterShard(config, torch.zeros(4))
        g = torch.ones(4)
        for version in range(3):
            await asyncio.wait_for(shard.push_sync(g, 0, version), 1)
        assert shard.step == 3 and shard.hold_at == 3
        held = asyncio.create_task(shard.push_sync(g, 0, 3))
        await asyncio.sleep(0.2)
        assert not held.done() and shard.step == 3  # paused for the snapshot
        state = await shard.get_state()
        await shard.release()
        await asyncio.wait_for(held, 1)
        return state["step"], shard.step, shard.hold_at

    assert asyncio.run(main()) == (3, 4, None)


def test_stop_at_ends_training_exactly_at_that_step():
    async def main():
        config = {"index": 0, "mode": "async", "steps": 100, "num_replicas": 1,
                  "optimizer": {"name": "sgd", "lr": 1.0}}
        shard = ParameterShard(config, torch.zeros(4))
        g = torch.ones(4)
        for _ in range(3):
            await shard.push_pull(g, 0, shard.step)
        await shard.stop_at(5)
        replies = [await shard.push_pull(g, 0, shard.step) for _ in range(4)]
        return [(step, stop) for _, step, stop, _ in replies]

    assert asyncio.run(main()) == [(4, False), (5, True), (5, True), (5, True)]


def test_retiring_a_replica_does_not_wait_on_a_checkpoint_hold():
    """The chief retires a replica (an elastic leave, the end of its data) from the loop that also
    releases the checkpoint hold: waiting on the hold there deadlocked until the barrier timeout.
    Under the hold no gradient of the held step is in, so the retirement applies nothing; after
    the release the other replica alone makes each step."""
    async def main():
        config = {"index": 0, "mode": "sync", "steps": 100, "num_replicas": 2, "replicas_to_aggregate": 2,
                  "checkpoint_every": 1, "optimizer": {"name": "sgd", "lr": 1.0}, "barrier_timeout_s": 5}
        shard = ParameterShard(config, torch.zeros(4))
        g = torch.ones(4)
        await asyncio.gather(shard.push_sync(g, 0, 0), shard.push_sync(g, 1, 0))
        assert shard.step == 1 and shard.hold_at == 1
        step = await asyncio.wait_for(shard.excuse(1, None, "retire"), 1)  # held: it must not wait
        params = shard.param.clone()
        await shard.release()
        await asyncio.wait_for(shard.push_sync(g, 0, 1), 1)  # replica 0 alone completes step 2
        return step, params, shard.step

    step, params, after = asyncio.run(main())
    assert step == 1 and torch.equal(params, -torch.ones(4)) and after == 2
