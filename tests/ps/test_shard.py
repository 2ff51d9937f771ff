"""ParameterShard on its own event loop (as on a ps worker): barriers, their grace, reply buffers."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dtrain.ps.shard import BarrierTimeout, ParameterShard


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

    assert 0.4 < asyncio.run(main()) < 5


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
        assert shard._ring == []  # nothing allocated until an actor-path reply needs it
        out = torch.empty(4)
        params, step, *_ = await shard.push_pull(torch.ones(4), 0, 0, out=out)
        assert params is out and step == 1 and torch.equal(out, -torch.ones(4)) and shard._ring == []
        a, *_ = await shard.pull()
        b, *_ = await shard.pull()
        assert a.data_ptr() != b.data_ptr() and len(shard._ring) == 2  # snapshots, not the live buffer
        assert a.data_ptr() != shard.param.data_ptr()

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
        return params, step, shard.sync.excused

    params, step, excused = asyncio.run(main())
    assert step == 1 and torch.equal(params, torch.full((8,), -2.0)) and excused == set()
