"""Moving averages on the ps (training.moving_average): TF's ExponentialMovingAverage formula with
hand-computed values, and a ParameterShard updating them after every apply (async, sync,
in-graph), carrying them in its state and restoring them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dtrain.ps.averages import MovingAverage, decay_at, make_average
from dtrain.ps.shard import ParameterShard


def test_decay_is_tf_min_of_decay_and_the_step_ratio():
    # TF: decay = min(decay, (1 + num_updates) / (10 + num_updates)) when num_updates is given.
    assert decay_at(0.999, None) == 0.999
    assert decay_at(0.999, 0) == pytest.approx(0.1)
    assert decay_at(0.999, 5) == pytest.approx(6 / 15)
    assert decay_at(0.999, 90) == pytest.approx(91 / 100)
    assert decay_at(0.999, 100_000) == 0.999  # 100001/100010 > 0.999


def test_update_is_tf_shadow_minus_one_minus_decay_times_difference():
    ema = MovingAverage(torch.tensor([1.0, 2.0]), decay=0.9)
    ema.update(torch.tensor([2.0, 4.0]), step=1)  # 0.9*1 + 0.1*2, 0.9*2 + 0.1*4
    assert torch.allclose(ema.shadow, torch.tensor([1.1, 2.2]), atol=1e-7)
    ema.update(torch.tensor([0.0, 0.0]), step=2)  # 0.9*1.1, 0.9*2.2
    assert torch.allclose(ema.shadow, torch.tensor([0.99, 1.98]), atol=1e-7)


def test_num_updates_uses_the_step_after_the_apply():
    ema = MovingAverage(torch.tensor([1.0]), decay=0.9, num_updates=True)
    ema.update(torch.tensor([2.0]), step=1)  # decay min(0.9, 2/11): 2/11*1 + 9/11*2 = 20/11
    assert torch.allclose(ema.shadow, torch.tensor([20 / 11]), atol=1e-6)
    ema.update(torch.tensor([0.0]), step=2)  # decay 3/12: 20/11 * 1/4
    assert torch.allclose(ema.shadow, torch.tensor([5 / 11]), atol=1e-6)


def test_the_shadow_is_a_copy_and_state_round_trips():
    init = torch.tensor([3.0, 4.0])
    ema = MovingAverage(init, decay=0.5)
    init.zero_()
    assert torch.equal(ema.shadow, torch.tensor([3.0, 4.0]))  # TF: starts at the initial value
    saved = ema.state()
    ema.update(torch.zeros(2), step=1)
    ema.load(saved, torch.zeros(2))
    assert torch.equal(ema.shadow, torch.tensor([3.0, 4.0]))
    ema.load(None, torch.tensor([7.0, 8.0]))  # a checkpoint without averages: start from the variables
    assert torch.equal(ema.shadow, torch.tensor([7.0, 8.0]))
    assert make_average(None, init) is None


def _shard(mode: str, ema: dict | None, replicas: int = 1) -> ParameterShard:
    config = {"index": 0, "mode": mode, "steps": 100, "num_replicas": replicas, "replicas_to_aggregate": replicas,
              "optimizer": {"name": "sgd", "lr": 1.0}, "moving_average": ema}
    return ParameterShard(config, torch.zeros(3))


def test_async_shard_updates_the_average_after_every_applied_push():
    async def main():
        shard = _shard("async", {"decay": 0.9})
        await shard.push_pull(torch.ones(3), 0, 0)  # param -1: shadow 0.9*0 + 0.1*-1
        first, _ = await shard.get_params(averaged=True)
        await shard.push_pull(torch.ones(3), 0, 1)  # param -2: shadow 0.9*-0.1 + 0.1*-2
        second, step = await shard.get_params(averaged=True)
        raw, _ = await shard.get_params()
        return first, second, step, raw

    first, second, step, raw = asyncio.run(main())
    assert step == 2 and torch.equal(raw, torch.full((3,), -2.0))
    assert torch.allclose(first, torch.full((3,), -0.1))
    assert torch.allclose(second, torch.full((3,), -0.29))


def test_sync_shard_updates_the_average_once_per_aggregated_step():
    async def main():
        shard = _shard("sync", {"decay": 0.5, "num_updates": True}, replicas=2)
        await asyncio.gather(shard.push_sync(torch.full((3,), 1.0), 0, 0),
                             shard.push_sync(torch.full((3,), 3.0), 1, 0))  # mean 2: param -2
        return await shard.get_params(averaged=True)

    shadow, step = asyncio.run(main())
    # One update at step 1: decay min(0.5, 2/11) = 2/11; shadow = 9/11 * -2 (not two updates).
    assert step == 1 and torch.allclose(shadow, torch.full((3,), -18 / 11))


def test_in_graph_apply_updates_the_average():
    async def main():
        shard = _shard("sync", {"decay": 0.75}, replicas=2)
        await shard.apply_mean(torch.full((3,), 4.0), 2, 0)  # mean 2: param -2, shadow 0.25*-2
        return await shard.get_params(averaged=True)

    shadow, _ = asyncio.run(main())
    assert torch.allclose(shadow, torch.full((3,), -0.5))


def test_shard_state_carries_the_averages_and_a_restore_sets_them():
    async def main():
        shard = _shard("async", {"decay": 0.9})
        await shard.push_pull(torch.ones(3), 0, 0)
        state = await shard.get_state()
        other = _shard("async", {"decay": 0.9})
        await other.set_state(state)
        restored, _ = await other.get_params(averaged=True)
        without = {k: v for k, v in state.items() if k != "averages"}
        third = _shard("async", {"decay": 0.9})
        await third.set_state(without)
        started, _ = await third.get_params(averaged=True)
        plain = _shard("async", None)
        return state, restored, started, await plain.get_state(), await plain.get_params(averaged=True)

    state, restored, started, plain_state, (plain_params, _) = asyncio.run(main())
    assert torch.allclose(state["averages"], torch.full((3,), -0.1))
    assert torch.equal(restored, state["averages"])
    assert torch.equal(started, state["params"])  # no averages in the checkpoint: from the variables
    assert "averages" not in plain_state  # no moving_average: nothing kept
    assert torch.equal(plain_params, torch.zeros(3))  # averaged=True falls back to the variables
