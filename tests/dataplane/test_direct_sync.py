"""Direct sync pushes (ps/sync_push.py): the barrier on the data plane's connection threads, under
the shard's lock, woken from either side (a push or an excuse on the event loop, a stop), never
past a checkpoint hold, with the barrier timeout and grace of the loop's path. Real
ParameterShards, real ShardServers and real connections on 127.0.0.1; no mocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.protocol import DataPlaneError
from dtrain.dataplane.server import ShardServer
from tests.helpers.dataplane import make_shard
from tests.helpers.waiting import wait_until

SECRET = b"y" * 32
LR = 0.5  # make_shard's SGD learning rate


def on_loop(loop, coro, timeout=5):  # noqa: F811
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def clients(server, n, replicas, shm=False):  # noqa: F811
    return [SocketShard(server.host, server.port, SECRET, replica=r, numel=n, timeout=10, shared_memory=shm)
            for r in range(replicas)]


def close(server, cs, stopped=None):
    for c in cs:
        c.close()
    server.close()
    if stopped is not None:
        stopped.close()


def test_the_barrier_runs_on_connection_threads_and_applies_the_exact_mean(shm):  # noqa: F811
    """The event loop never runs: 3 replicas meet at the barrier for 15 steps anyway (through the
    loop every push would fail after the server's 2 s), and the parameters are exactly sync SGD
    on the mean of each step's gradients; the first two of each step wait for the third."""
    stopped = asyncio.new_event_loop()
    n = 500
    shard = make_shard(mode="sync", n=n, replicas=3, barrier_timeout_s=30)  # (a missed wake-up: 30 s)
    server = ShardServer(shard, stopped, SECRET, timeout=2)
    cs = clients(server, n, 3, shm)
    expected = torch.ones(n)
    try:
        for k in range(15):
            grads = [torch.randn(n, generator=torch.Generator().manual_seed(100 * k + r)) for r in range(3)]
            first = [cs[r].push_sync(grads[r], r, k, 0.5, 8, k + 1) for r in range(2)]
            wait_until(lambda k=k: shard.meter.pushes == 3 * k + 2, 30.0, "both pushes in", every=0.005)  # both in: waiting at the barrier
            assert not any(f.done() for f in first) and shard.step == k
            last = cs[2].push_sync(grads[2], 2, k, 0.5, 8, k + 1)
            expected -= LR * (grads[0] + grads[1] + grads[2]) / 3
            for f in (*first, last):
                params, step, stop, _ = f.result(timeout=5)
                assert step == k + 1 and not stop
                torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)
        assert shard.core.records.samples_total == 15 * 3 * 8 and shard.meter.pushes == 45
    finally:
        close(server, cs, stopped)


def test_a_stale_push_is_dropped_at_once_and_a_duplicate_waits_with_its_first(loop):  # noqa: F811
    shard = make_shard(mode="sync", n=4, replicas=2)
    server = ShardServer(shard, loop, SECRET)
    a, b = cs = clients(server, 4, 2)
    try:
        fa = a.push_sync(torch.ones(4), 0, 0)
        b.push_sync(torch.ones(4) * 3, 1, 0).result(5)
        assert fa.result(5)[1] == 1
        params, step, *_ = b.push_sync(torch.ones(4) * 100, 1, 0).result(5)  # computed on step 0: stale
        assert step == 1 and torch.equal(params, torch.full((4,), 1 - LR * 2.0)) and shard.dropped_stale == 1
    finally:
        close(server, cs)


@pytest.mark.parametrize("first", ["direct", "loop"])
def test_a_loop_push_and_a_direct_push_complete_each_others_step(loop, first):  # noqa: F811
    """The actor path (``push_sync`` on the event loop) and a data-plane push share one barrier:
    whichever waits is woken by the other's apply (a direct apply wakes loop waiters through the
    loop; a loop apply notifies the threads' condition)."""
    shard = make_shard(mode="sync", n=6, replicas=2, barrier_timeout_s=3)
    server = ShardServer(shard, loop, SECRET)
    (client,) = cs = clients(server, 6, 1)
    try:
        if first == "direct":
            waiting = client.push_sync(torch.ones(6), 0, 0)
            time.sleep(0.1)
            assert not waiting.done()
            loop_reply = on_loop(loop, shard.push_sync(torch.ones(6) * 3, 1, 0))
            direct_reply = waiting.result(2)
        else:
            waiting = asyncio.run_coroutine_threadsafe(shard.push_sync(torch.ones(6) * 3, 1, 0), loop)
            time.sleep(0.1)
            assert not waiting.done()
            direct_reply = client.push_sync(torch.ones(6), 0, 0).result(5)
            loop_reply = waiting.result(2)
        for params, step, *_ in (loop_reply, direct_reply):
            assert step == 1 and torch.equal(params, torch.full((6,), 1 - LR * 2.0))
    finally:
        close(server, cs)


def test_an_excuse_on_the_loop_releases_a_direct_waiter(loop):  # noqa: F811
    """Replica 1 was lost: the chief's excuse applies replica 0's gradient alone and wakes it."""
    shard = make_shard(mode="sync", n=4, replicas=2, barrier_timeout_s=3)
    server = ShardServer(shard, loop, SECRET)
    (a,) = cs = clients(server, 4, 1)
    try:
        waiting = a.push_sync(torch.ones(4) * 2, 0, 0)
        time.sleep(0.1)
        assert not waiting.done()
        assert on_loop(loop, shard.excuse(1, 0)) == 1
        params, step, *_ = waiting.result(2)
        assert step == 1 and torch.equal(params, torch.full((4,), 1 - LR * 2.0))
    finally:
        close(server, cs)


@pytest.mark.parametrize("how", ["request_stop", "nan"])
def test_a_stop_or_an_error_releases_a_direct_waiter(loop, how):  # noqa: F811
    """A stop from the chief (on the loop), or replica 1's non-finite gradient under nan_guard (on
    its own connection thread), answers the waiting replica 0 with the stop flag at once."""
    shard = make_shard(mode="sync", n=4, replicas=3, barrier_timeout_s=5, nan_guard=True)
    server = ShardServer(shard, loop, SECRET)
    a, b = cs = clients(server, 4, 2)
    try:
        waiting = a.push_sync(torch.ones(4), 0, 0)
        wait_until(lambda: shard.meter.pushes == 1, 30.0, "the push in", every=0.005)  # waiting at the barrier
        t0 = time.monotonic()
        if how == "request_stop":
            on_loop(loop, shard.request_stop())
        else:
            b.push_sync(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 1, 0).result(5)
            assert "non-finite gradient" in shard.error
        # At once: well before the 5 s barrier timeout would answer it (with an error, no stop).
        _params, step, stop, _ = waiting.result(4)
        assert stop and step == 0 and time.monotonic() - t0 < 4
    finally:
        close(server, cs)


def test_the_barrier_times_out_on_the_thread_unless_a_grace_is_granted(loop):  # noqa: F811
    """barrier_timeout_s bounds a direct wait (BarrierTimeout, which the session retries); a grace
    from the session (a lost replica is being restarted) lets it outlast that timeout."""
    for grace in (None, 10.0):
        shard = make_shard(mode="sync", n=4, replicas=2, barrier_timeout_s=0.5)
        server = ShardServer(shard, loop, SECRET, timeout=10)
        a, b = cs = clients(server, 4, 2)
        try:
            t0 = time.monotonic()
            if grace is None:
                with pytest.raises(DataPlaneError, match=r"BarrierTimeout: replica 0 waited .*barrier_timeout_s: 0"):
                    a.push_sync(torch.ones(4), 0, 0).result(8)
                assert 0.4 < time.monotonic() - t0  # (not before barrier_timeout_s; the server's 10 s: no answer in 8)
                continue
            on_loop(loop, shard.barrier_grace(grace))
            waiting = a.push_sync(torch.ones(4), 0, 0)
            wait_until(lambda shard=shard: shard.meter.pushes == 1, 30.0, "the push in", every=0.005)  # waiting at the barrier
            pushed = time.monotonic()
            while time.monotonic() < pushed + 1.0:  # past barrier_timeout_s (0.5 s), inside the grace (10 s)
                assert not waiting.done()
                time.sleep(0.05)
            b.push_sync(torch.ones(4), 1, 0).result(5)
            assert waiting.result(5)[1] == shard.step == 1
        finally:
            close(server, cs)


def test_a_checkpoint_hold_keeps_the_next_step_off_the_parameters(loop):  # noqa: F811
    """checkpoint_every 2: the step-2 apply (on a connection thread) holds the shard; pushes for
    step 2 then wait on the loop, the snapshot sees step 2's parameters, and after release the
    step completes (and goes direct again)."""
    shard = make_shard(mode="sync", n=4, replicas=2, checkpoint_every=2)
    server = ShardServer(shard, loop, SECRET)
    a, b = cs = clients(server, 4, 2)
    g = torch.ones(4)
    try:
        for k in range(2):
            fa = a.push_sync(g, 0, k)
            b.push_sync(g, 1, k).result(5)
            fa.result(5)
        assert shard.hold_at == 2 and shard.step == 2
        fa, fb = a.push_sync(g, 0, 2), b.push_sync(g, 1, 2)
        time.sleep(0.3)
        assert not fa.done() and not fb.done() and shard.step == 2
        state = on_loop(loop, shard.get_state())
        assert state["step"] == 2 and torch.equal(state["params"], torch.full((4,), 1 - LR * 2))
        on_loop(loop, shard.release())
        assert fa.result(5)[1] == fb.result(5)[1] == 3
        fa = a.push_sync(g, 0, 3)
        assert b.push_sync(g, 1, 3).result(5)[1] == 4 and fa.result(5)[1] == 4
        assert torch.equal(shard.param, torch.full((4,), 1 - LR * 4))
    finally:
        close(server, cs)


def test_concurrent_replicas_and_checkpoint_reads_lose_no_update(loop, shm):  # noqa: F811
    """3 replicas push 40 steps each as fast as they can while the loop reads get_state: every
    step applies the mean of exactly 3 gradients (the sum is known), and every state read is a
    consistent (step, parameters) pair."""
    shard = make_shard(mode="sync", n=256, replicas=3)
    server = ShardServer(shard, loop, SECRET)
    cs = clients(server, 256, 3, shm)
    steps = 40
    try:
        def run(r):
            for k in range(steps):
                cs[r].push_sync(torch.full((256,), float(r + 1)), r, k).result(10)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        reads = []
        while any(t.is_alive() for t in threads):
            reads.append(on_loop(loop, shard.get_state(tables=False)))
        for t in threads:
            t.join()
        # (atol: the mean's 1/3 is folded into the learning rate, a rounding away from exact 0 at
        # step 1; one step apart is 1.0)
        assert shard.step == steps and torch.allclose(shard.param, torch.full((256,), 1 - LR * 2.0 * steps), atol=1e-6)
        for state in reads:  # (mean gradient 2.0 every step)
            assert torch.allclose(state["params"], torch.full((256,), 1 - LR * 2.0 * state["step"]), atol=1e-6)
    finally:
        close(server, cs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_held_shard_that_stops_answers_loop_calls_at_once(loop, mode):  # noqa: F811
    """A checkpoint hold and then a stop (the run ends, or its chief is lost, while the chief holds
    the shard): a push, an excuse or an in-graph apply waiting on the hold is released by the stop
    and answered at once. The re-check after the wait once saw only the hold and went round
    again without yielding: the event loop spun forever (its cluster could not close)."""
    shard = make_shard(mode=mode, n=4, replicas=2)
    assert on_loop(loop, shard.hold()) == 0
    calls = [shard.push_sync(torch.ones(4), 0, 0)] if mode == "sync" else [shard.push_pull(torch.ones(4), 0, 0)]
    if mode == "sync":
        calls += [shard.excuse(1, 0), shard.apply_mean(torch.ones(4), 2, 0)]
    waiting = [asyncio.run_coroutine_threadsafe(c, loop) for c in calls]
    time.sleep(0.2)
    assert not any(w.done() for w in waiting)  # held
    on_loop(loop, shard.request_stop())
    for w in waiting:
        w.result(2)
    assert shard.step == 0 and on_loop(loop, shard.current_step()) == 0  # nothing applied; the loop is free
