"""AsyncPush on its own (ps/fastpath.py), on a ShardCore, ShardWaits and ShardControl of its own:
when the direct path may be taken, the direct push's apply and reply and when it declines, the
wake-up of the loop's waiters, and the loop's push_pull with holds and the staleness gate.
Real torch, no ParameterShard, no Dask."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from dtrain.ps.control import ShardControl
from dtrain.ps.fastpath import AsyncPush
from tests.helpers.ps_parts import core_of, loop_thread, refusing_states, thread_loop_waiter


def async_of(mode: str = "async", **config: Any):
    core, waits = core_of(mode, **config)
    control = ShardControl(core, waits)
    return core, waits, control, AsyncPush(core, waits, control)


@pytest.mark.parametrize(("mode", "config", "direct"), [
    ("async", {}, True),
    ("async", {"max_staleness": 1, "replicas": 2}, False),  # shard 0 gates the replicas: a push may wait
    ("async", {"max_staleness": 1, "replicas": 2, "index": 1}, True),  # no gate off shard 0: drops only
    ("sync", {}, False),
])
def test_the_direct_path_only_where_nothing_can_make_a_push_wait(mode, config, direct):
    """Fails if a gated shard's pushes go direct (a push that must wait for slower replicas would
    not), or a sync shard's async path does."""
    assert async_of(mode, **config)[3].direct is direct


def test_a_direct_push_applies_and_replies_under_the_lock():
    """Fails if the direct push skips the apply, the meter or the report (``observe``), or replies
    anywhere but the caller's buffer."""
    core, _, _, pushes = async_of()
    out = torch.empty(4)
    loop = asyncio.new_event_loop()
    try:
        params, step, stop, generation = pushes.push_direct(loop, torch.ones(4), 0, 0, 1.5, 8, 1, out)
    finally:
        loop.close()
    assert params is out and (step, stop, generation) == (1, False, 0) and torch.equal(out, -torch.ones(4))
    assert core.meter is not None and (core.meter.pushes, core.meter.applies) == (1, 1)
    assert core.records.local_steps == {0: 1} and core.records.samples_total == 8


def test_a_too_stale_or_bad_push_is_counted_but_not_applied():
    """Fails if a push more than max_staleness updates old is applied (or not counted as dropped),
    or if a non-finite gradient under nan_guard is applied (the reply must then say stop)."""
    core, _, _, pushes = async_of(max_staleness=0, index=1, replicas=2, nan_guard=True)
    with core.waits.lock:
        pushes.apply(torch.ones(4), 0, 0, None, 0, 0)
        pushes.apply(torch.ones(4), 1, 0, None, 0, 0)  # on step 0's parameters at step 1: 1 > 0
    assert core.step == 1 and core.dropped_stale == 1 and torch.equal(core.param, -torch.ones(4))
    loop = asyncio.new_event_loop()
    try:
        reply = pushes.push_direct(loop, torch.full((4,), math.inf), 0, 1, None, 0, 0, torch.empty(4))
    finally:
        loop.close()
    assert reply is not None and reply[1:3] == (1, True) and torch.equal(core.param, -torch.ones(4))


def test_a_direct_push_goes_to_the_loop_while_held_stopped_or_failed():
    """Fails if the direct push applies through a checkpoint hold, a stop or an error: it must
    return None (the loop's path then waits or answers) without touching anything."""
    core, _, _, pushes = async_of()
    loop = asyncio.new_event_loop()
    try:
        for name in refusing_states(core):
            assert pushes.push_direct(loop, torch.ones(4), 0, 0, None, 8, 1, torch.empty(4)) is None, name
    finally:
        loop.close()
    assert core.step == 0 and core.meter is not None and core.meter.pushes == 0 and core.records.samples_total == 0


def test_a_direct_apply_wakes_the_loops_waiters():
    """Fails if a direct apply does not wake a waiter counted on the loop (a pull of the next step
    would sleep to its timeout)."""
    core, waits, _, pushes = async_of()
    with loop_thread() as loop:
        pulled = thread_loop_waiter(loop, waits, lambda: core.step >= 2, "the pull", then=lambda: core.step)
        for version in range(2):
            pushes.push_direct(loop, torch.ones(4), 0, version, None, 0, 0, torch.empty(4))
        assert pulled.result(timeout=2) == 2


def test_push_pull_waits_out_a_hold():
    """Fails if the loop's push applies while the chief holds the shard for a snapshot."""
    async def main():
        core, _, control, pushes = async_of()
        await control.hold()
        pushed = asyncio.create_task(pushes.push_pull(torch.ones(4), 0, 0))
        await asyncio.sleep(0.05)
        assert not pushed.done() and core.step == 0
        await control.release()
        _, step, *_ = await asyncio.wait_for(pushed, 2)
        return step

    assert asyncio.run(main()) == 1


def test_push_pull_holds_a_replica_too_far_ahead_until_the_slowest_reports():
    """SSP, max_staleness 1: fails if a replica 2 local steps ahead of the slowest gets its reply
    (after its push is applied) before the slowest reports; it then replies with the step the
    slow replica's push made."""
    async def main():
        core, _, _, pushes = async_of(max_staleness=1, replicas=2)
        await asyncio.wait_for(pushes.push_pull(torch.ones(4), 0, 0, None, 0, 0), 1)  # next: local 1
        ahead = asyncio.create_task(pushes.push_pull(torch.ones(4), 0, 1, None, 0, 1))  # next: local 2
        await asyncio.sleep(0.1)
        assert not ahead.done() and core.step == 2
        await pushes.push_pull(torch.ones(4), 1, 2, None, 0, 1)
        _, step, *_ = await asyncio.wait_for(ahead, 2)
        return step

    assert asyncio.run(main()) == 3
