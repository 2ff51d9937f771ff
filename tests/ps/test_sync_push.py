"""The sync barrier's parts on their own (ps/sync_push.py): GradientSum (copied and borrowed
gradients) and SyncBarrier on a ShardCore, ShardWaits and ShardControl of its own: the quorum's
mean, stale and refused gradients, the loop's and the connection thread's pushes, excuses and
in-graph means. Real torch, no ParameterShard, no Dask."""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest
import torch

from dtrain.ps.control import ShardControl
from dtrain.ps.replication import Accumulate, Apply, Drop
from dtrain.ps.sync_push import GradientSum, SyncBarrier
from tests.helpers.ps_parts import Sleeper, core_of, loop_thread, refusing_states, thread_loop_waiter
from tests.helpers.waiting import wait_until


def test_a_loop_push_copies_its_gradient_and_the_next_adds_to_it():
    """Fails if a first gradient is kept where it lies on the loop's path (the connection thread
    that gave up on that push reads its next request into it) or the second is not added."""
    s = GradientSum(torch.zeros(3), sync=True)
    g0 = torch.tensor([1.0, 2.0, 3.0])
    s.add(g0, 1)
    g0.fill_(100.0)
    s.add(torch.ones(3), 2)
    assert s.summed() is s.acc and torch.equal(s.acc, torch.tensor([2.0, 3.0, 4.0]))


def test_a_borrowed_gradient_is_read_where_it_lies_and_never_written():
    """Fails if the sum of a borrowed gradient and the next is written into either pusher's buffer,
    or if a lone borrowed gradient is not the one applied (the stale ``acc`` would be)."""
    s = GradientSum(torch.zeros(3), sync=True)
    g0, g1 = torch.full((3,), 2.0), torch.full((3,), 4.0)
    s.add(g0, 1, borrow=True)
    assert s.first is g0
    s.add(g1, 2, borrow=True)
    assert torch.equal(s.summed(), torch.full((3,), 6.0)) and s.first is None
    assert torch.equal(g0, torch.full((3,), 2.0)) and torch.equal(g1, torch.full((3,), 4.0))
    s.add(g0, 1, borrow=True)
    assert s.summed() is g0 and s.first is None


def test_a_borrowed_gradient_is_copied_in_when_its_pusher_leaves_early():
    """A direct push that times out leaves; its replica then reuses the buffer. Fails if own_first
    does not copy it in (the step's sum would read the reused buffer) or copies another's."""
    s = GradientSum(torch.zeros(3), sync=True)
    g0 = torch.full((3,), 2.0)
    s.add(g0, 1, borrow=True)
    s.own_first(torch.full((3,), 9.0))  # another push's gradient: not the borrowed one
    assert s.first is g0
    s.own_first(g0)
    g0.fill_(100.0)
    s.add(torch.ones(3), 2)
    assert torch.equal(s.summed(), torch.full((3,), 3.0))


def test_reset_forgets_the_steps_gradients_and_async_has_no_buffer():
    """Fails if a restore keeps a half step's gradients (they would land in the restored step)."""
    s = GradientSum(torch.zeros(3), sync=True)
    s.add(torch.ones(3), 1)
    s.reset()
    s.add(torch.ones(3), 2)
    assert torch.equal(s.summed(), torch.ones(3))
    s.add(torch.ones(3), 1, borrow=True)
    s.reset()
    assert s.first is None
    assert GradientSum(torch.zeros(3), sync=False).acc.numel() == 0


def barrier_of(replicas: int = 2, mode: str = "sync", **config: Any):
    core, waits = core_of(mode, replicas=replicas, replicas_to_aggregate=replicas, **config)
    control = ShardControl(core, waits)
    return core, waits, control, SyncBarrier(core, waits, control, GradientSum(core.param, mode == "sync"))


@pytest.mark.parametrize(("mode", "config", "direct"), [("sync", {}, True), ("sync", {"sync_tokens": True}, False),
                                                        ("async", {}, False)])
def test_only_the_barrier_goes_direct(mode, config, direct):
    """Fails if the token queue (whose waits stay on the loop) or async mode take this direct path."""
    assert barrier_of(mode=mode, **config)[3].direct is direct


def test_the_quorums_last_gradient_applies_the_mean_and_a_stale_one_is_dropped():
    """Fails if the first gradient applies, the mean is not over the quorum, or a gradient of a
    past step is applied instead of dropped (and counted)."""
    core, waits, _, barrier = barrier_of()
    with waits.lock:
        assert isinstance(barrier.accumulate(torch.full((4,), 2.0), 0, 0, None, 8, 1, None), Accumulate)
        assert torch.equal(core.param, torch.zeros(4))
        assert isinstance(barrier.accumulate(torch.full((4,), 4.0), 1, 0, None, 8, 1, None), Apply)
        assert core.step == 1 and torch.equal(core.param, torch.full((4,), -3.0))
        assert isinstance(barrier.accumulate(torch.ones(4), 0, 0, None, 8, 1, None), Drop)
    assert core.dropped_stale == 1 and torch.equal(core.param, torch.full((4,), -3.0))


def test_a_non_finite_gradient_is_refused_before_the_barrier_counts_it():
    """Fails if a NaN gradient under nan_guard enters the step (its mean would be NaN), if the
    refusal does not wake the connection threads waiting at the barrier (they would sleep to their
    timeout), or if a direct push is still taken after the error."""
    core, waits, _, barrier = barrier_of(nan_guard=True)
    sleeper = Sleeper(waits).start_sleeping()
    with waits.lock:
        assert barrier.accumulate(torch.full((4,), math.nan), 0, 0, None, 8, 1, None) is None
    sleeper.join(5)
    assert sleeper.notified is True
    assert core.error is not None and core.sync.contributors == set()
    loop = asyncio.new_event_loop()
    try:
        assert barrier.push_direct(loop, torch.ones(4), 1, 0, None, 0, 0, torch.empty(4)) is None
    finally:
        loop.close()


def test_loop_pushes_wait_for_their_step_and_a_hold():
    """Fails if a push returns before its step is applied, or applies while the chief holds the
    shard for a snapshot."""
    async def main():
        core, _, control, barrier = barrier_of()
        first = asyncio.create_task(barrier.push(torch.full((4,), 2.0), 0, 0))
        await asyncio.sleep(0.05)
        assert not first.done()
        p1, s1, *_ = await barrier.push(torch.full((4,), 4.0), 1, 0)
        p0, s0, *_ = await asyncio.wait_for(first, 2)
        assert s0 == s1 == 1 and torch.equal(p0, torch.full((4,), -3.0)) and torch.equal(p1, p0)
        await control.hold()
        held = [asyncio.create_task(barrier.push(torch.ones(4), r, 1)) for r in (0, 1)]
        await asyncio.sleep(0.1)
        assert core.step == 1 and not any(t.done() for t in held)
        await control.release()
        assert [(await asyncio.wait_for(t, 2))[1] for t in held] == [2, 2]

    asyncio.run(main())


def test_a_direct_push_goes_to_the_loop_while_held_stopped_or_failed():
    """Fails if the connection thread's push ignores a hold of its step, a stop or an error (it
    would apply during a snapshot, or past the end): None, and nothing counted; or if a hold of a
    later step sends it there (that step is the one the snapshot waits for)."""
    core, _, _, barrier = barrier_of(replicas=1)
    loop = asyncio.new_event_loop()
    try:
        for name in refusing_states(core):
            assert barrier.push_direct(loop, torch.ones(4), 0, 0, None, 0, 0, torch.empty(4)) is None, name
        assert core.meter is not None and core.meter.pushes == 0 and core.step == 0
        core.hold_at, core.error = 1, None
        reply = barrier.push_direct(loop, torch.ones(4), 0, 0, None, 0, 0, torch.empty(4))
        assert reply is not None and reply[1] == 1 and core.hold_at == 1
    finally:
        loop.close()


def test_direct_pushes_meet_on_the_threads_and_wake_the_loops_waiters():
    """Two connection threads complete a step between them; a waiter on the loop (a pull of that
    step) is woken. Fails if the first returns before the second's gradient, or if a direct apply
    does not wake the loop when a waiter is counted (it would sleep to its timeout)."""
    core, waits, _, barrier = barrier_of()
    with loop_thread() as loop:
        pulled = thread_loop_waiter(loop, waits, lambda: core.step >= 1, "the pull", then=lambda: core.step)
        replies: list[Any] = []
        first = threading.Thread(target=lambda: replies.append(
            barrier.push_direct(loop, torch.full((4,), 2.0), 0, 0, None, 0, 0, torch.empty(4))))
        first.start()
        assert core.meter is not None
        wait_until(lambda: core.meter.pushes == 1, 10, "the first push in", every=0.005)
        assert not replies
        params, step, *_ = barrier.push_direct(loop, torch.full((4,), 4.0), 1, 0, None, 0, 0, torch.empty(4))
        first.join(5)
        assert step == 1 and replies[0][1] == 1 and torch.equal(replies[0][0], params)
        assert pulled.result(timeout=2) == 1


def test_the_push_that_completes_a_step_answers_the_waiting_push_itself():
    """A waiting direct push leaves its ``respond``; the completing push sends that reply from its
    own thread, with the applied step's parameters, and the waiter returns ANSWERED (nothing more
    to send). Fails if the waiter is left to answer itself after waking (a scheduling round per
    step on a busy machine), if its reply is sent twice or by its own thread, or if it carries
    the parameters of before the apply."""
    from dtrain.dataplane.protocol import ANSWERED

    core, _, _, barrier = barrier_of()
    with loop_thread() as loop:
        sent: list[tuple[int, tuple]] = []
        returned: list[Any] = []
        out0 = torch.empty(4)

        def respond(reply: tuple) -> None:
            sent.append((threading.get_ident(), (reply[0].clone(), *reply[1:])))

        first = threading.Thread(target=lambda: returned.append(
            barrier.push_direct(loop, torch.full((4,), 2.0), 0, 0, None, 0, 0, out0, respond=respond)))
        first.start()
        assert core.meter is not None
        wait_until(lambda: core.meter.pushes == 1, 10, "the first push in", every=0.005)
        params, step, *_ = barrier.push_direct(loop, torch.full((4,), 4.0), 1, 0, None, 0, 0, torch.empty(4),
                                               respond=lambda reply: sent.append((-1, reply)))
        first.join(5)
        assert returned == [ANSWERED] and step == 1
        assert len(sent) == 1 and sent[0][0] == threading.get_ident()  # the completer's thread, once
        assert torch.equal(params, torch.full((4,), -3.0))  # the mean of 2 and 4 applied
        assert sent[0][1][1] == 1 and torch.equal(sent[0][1][0], params) and torch.equal(out0, params)
        assert not barrier.waiters


def test_an_excuse_applies_the_gradients_in_and_a_retired_replica_frees_the_gate():
    """Fails if excusing a lost replica leaves the others waiting (the step is not applied with the
    gradients in), if an excuse of a step already past applies anything, or if a retired async
    replica still holds the staleness gate back."""
    async def main():
        core, _, _, barrier = barrier_of()
        waiting = asyncio.create_task(barrier.push(torch.full((4,), 2.0), 0, 0))
        await asyncio.sleep(0.05)
        assert await barrier.excuse(1, at_step=0) == 1
        params, step, *_ = await asyncio.wait_for(waiting, 2)
        assert step == 1 and torch.equal(params, torch.full((4,), -2.0))
        assert await barrier.excuse(1, at_step=0) == 1 and torch.equal(core.param, torch.full((4,), -2.0))
        gated, _, _, async_barrier = barrier_of(mode="async", max_staleness=1)
        assert gated.gate is not None and await async_barrier.excuse(1, None, "retire") == 0
        assert gated.gate.lost == {1}

    asyncio.run(main())


def test_apply_mean_applies_one_step_of_the_current_version_only():
    """In-graph replication: fails if the mean is not sum / count, if a sum computed on an older
    step is applied, or if the step's report is not recorded as replica 0's."""
    async def main():
        core, _, _, barrier = barrier_of(replicas=1)
        assert await barrier.apply_mean(torch.full((4,), 6.0), 3, 0, loss=0.5, samples=24) == 1
        assert torch.equal(core.param, torch.full((4,), -2.0))
        assert core.records.local_steps == {0: 1} and core.records.samples_total == 24
        assert await barrier.apply_mean(torch.full((4,), 6.0), 3, 0) == 1
        assert torch.equal(core.param, torch.full((4,), -2.0))

    asyncio.run(main())
