"""ParameterShard's push under training.sync_tokens on its own event loop (as on a ps worker): the
checklist's rows S2-S4 and S5-S9 through the real shard, its optimizer and its replies (the reply's
step is the token: the replica's next local step); and TokenPush on its own (ps/token_push.py),
on parts built by hand."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dtrain.ps.control import ShardControl
from dtrain.ps.shard import BarrierTimeout, ParameterShard
from dtrain.ps.sync_push import GradientSum, SyncBarrier
from dtrain.ps.token_push import TokenPush
from dtrain.ps.tokens import TokenSync
from tests.helpers.ps_parts import core_of


def token_shard(workers: int, to_aggregate: int, init_tokens: int | None, barrier_s: float = 5.0) -> ParameterShard:
    # [v0, v1, v_sparse row 0, v_sparse row 1] of sync_replicas_optimizer_test, SGD lr 2.0.
    config = {"index": 0, "mode": "sync", "steps": 100, "num_replicas": workers,
              "replicas_to_aggregate": to_aggregate, "sync_tokens": True, "init_tokens": init_tokens,
              "optimizer": {"name": "sgd", "lr": 2.0}, "barrier_timeout_s": barrier_s}
    return ParameterShard(config, torch.tensor([0.0, 1.0, 3.0, 4.0]))


def grad(i: int) -> torch.Tensor:
    return torch.tensor([0.1 + 0.2 * i, 0.9 + 0.2 * i, 0.0, 0.1 + 0.2 * i])


def test_two_workers_rows_s2_to_s4():
    async def main():
        shard = token_shard(2, 2, 2)
        local = [0, 0]

        async def run(i: int):
            params, local[i], stop, _ = await shard.push_sync(grad(i), i, local[i])
            return params.clone()

        # S2: w0 runs alone and finishes (an init token); w1's gradient completes the update.
        p = await run(0)
        assert torch.equal(p, torch.tensor([0.0, 1.0, 3.0, 4.0])) and shard.step == 0
        p = await run(1)
        assert shard.step == 1 and local == [0, 0]
        assert torch.allclose(p, torch.tensor([-0.4, -1.0, 3.0, 3.6]))
        # S3: both run again: stale (local step 0), dropped; they take tokens of step 1.
        await run(0)
        await run(1)
        assert shard.step == 1 and local == [1, 1] and shard.dropped_stale == 2
        assert torch.allclose(shard.param, torch.tensor([-0.4, -1.0, 3.0, 3.6]))
        # S4: concurrently: w0 waits on the empty queue until w1's gradient makes the update.
        w0 = asyncio.create_task(run(0))
        await asyncio.sleep(0.05)
        assert not w0.done() and shard.step == 1
        await run(1)
        await w0
        assert shard.step == 2 and local == [2, 2]
        assert torch.allclose(shard.param, torch.tensor([-0.8, -3.0, 3.0, 3.2]))

    asyncio.run(main())


def test_three_workers_one_backup_rows_s5_to_s9():
    async def main():
        shard = token_shard(3, 2, 3)
        local = [0, 0, 0]

        async def run(i: int):
            _, local[i], *_ = await shard.push_sync(grad(i), i, local[i])

        await run(0)
        await run(2)  # S5
        assert shard.step == 1 and torch.allclose(shard.param[:2], torch.tensor([-0.6, -1.2]))
        await run(1)  # S6: late, dropped; it takes the last init token
        assert local == [0, 0, 0] and shard.dropped_stale == 1
        for i in (0, 1, 2):  # S7: all stale
            await run(i)
        assert shard.step == 1 and local == [1, 1, 1] and shard.dropped_stale == 4
        w0 = asyncio.create_task(run(0))  # S8: w0 alone blocks
        await asyncio.sleep(0.05)
        assert not w0.done() and shard.step == 1
        await run(1)  # S9
        await w0
        assert shard.step == 2 and local[:2] == [2, 2]
        assert torch.allclose(shard.param[:2], torch.tensor([-1.0, -3.2]))

    asyncio.run(main())


def test_a_lone_replica_without_tokens_times_out_and_stop_releases_waiters():
    async def main():
        shard = token_shard(2, 2, 0, barrier_s=0.3)
        with pytest.raises(BarrierTimeout, match="waited for a sync token"):
            await shard.push_sync(grad(0), 0, 0)
        # The run's last update (steps: 1) stops the shard: a waiting replica gets the stop flag.
        shard = token_shard(2, 2, 0)
        shard.core.steps = 1
        w0 = asyncio.create_task(shard.push_sync(grad(0), 0, 0))
        await asyncio.sleep(0.05)
        _, step, stop, _ = await shard.push_sync(grad(1), 1, 0)
        assert stop and step == 1
        _, step, stop, _ = await w0
        assert stop and step == 1

    asyncio.run(main())


def test_a_restore_refills_the_init_tokens():
    async def main():
        shard = token_shard(2, 2, None)
        state = await shard.get_state()
        await shard.push_sync(grad(0), 0, 0)
        state["step"] = 5
        assert await shard.set_state(state) == 5
        assert list(shard.core.sync.tokens) == [5, 5] and shard.core.sync.count == 0
        _, step, *_ = await shard.push_sync(grad(0), 0, 5)
        assert step == 5  # an init token of the restored step

    asyncio.run(main())


def test_a_hold_placed_while_a_push_waits_for_the_lock_is_kept():
    """A push passes the hold check, then waits for the shard's condition; a hold placed meanwhile
    (the chief's snapshot) must still stop its apply. Without the re-check under the lock the
    apply landed during the hold, and the sync checkpoint was refused ("did not agree")."""
    async def main():
        shard = token_shard(2, 1, None)  # every gradient applies at once
        cond = shard.waits.condition()
        await cond.acquire()  # (what another push or a waiter holds, as the push comes)
        push = asyncio.create_task(shard.push_sync(grad(0), 0, 0))
        await asyncio.sleep(0.05)  # past its hold check, waiting for the condition
        hold = asyncio.create_task(shard.hold())  # holds at once, then waits to wake the others
        await asyncio.sleep(0.05)
        assert shard.hold_at == 0 and not push.done()
        cond.release()
        await asyncio.sleep(0.2)
        assert shard.step == 0 and not push.done()  # no apply under the hold
        await hold
        await shard.release()
        await asyncio.wait_for(push, 5)
        assert shard.step == 1  # and it applies once released

    asyncio.run(main())


def token_push_of(workers: int, to_aggregate: int, init_tokens: int | None):
    core, waits = core_of("sync", replicas=workers, replicas_to_aggregate=to_aggregate, sync_tokens=True,
                          init_tokens=init_tokens)
    control = ShardControl(core, waits)
    barrier = SyncBarrier(core, waits, control, GradientSum(core.param, True))
    assert isinstance(core.sync, TokenSync)
    return core, TokenPush(core, waits, control, barrier, core.sync)


def test_a_token_push_replies_with_the_token_it_took():
    """Every gradient applies (1 to aggregate) and enqueues 2 tokens, behind the 2 init tokens of
    step 0: fails if the reply's step is the shard's step instead of the token dequeued (the
    replica's next local step, TensorFlow's), or if the gradient is not applied through the
    barrier's body (mean over the update's gradients)."""
    async def main():
        core, push = token_push_of(2, 1, 2)
        _, token, *_ = await push.push(torch.full((4,), 2.0), 0, 0, None, 0, 0, None, None)
        assert token == 0 and core.step == 1 and torch.equal(core.param, torch.full((4,), -2.0))
        assert list(core.sync.tokens) == [0, 1, 1]

    asyncio.run(main())


def test_a_token_push_waits_only_while_the_queue_is_empty():
    """No init tokens: fails if a push returns without a token (its replica would run ahead of the
    update), or if the update's tokens do not wake it (it would time out)."""
    async def main():
        core, push = token_push_of(2, 2, 0)
        first = asyncio.create_task(push.push(torch.full((4,), 2.0), 0, 0, None, 0, 0, None, None))
        await asyncio.sleep(0.05)
        assert not first.done() and core.step == 0
        _, token, *_ = await push.push(torch.full((4,), 4.0), 1, 0, None, 0, 0, None, None)
        _, other, *_ = await asyncio.wait_for(first, 2)
        assert token == other == 1 and torch.equal(core.param, torch.full((4,), -3.0))

    asyncio.run(main())
