"""Direct async pushes (ps/fastpath.py): applied on the data plane's connection thread under the
shard's lock, never on the event loop, and never past a checkpoint hold, a stop or an error.
Real ParameterShards, real ShardServers and real connections on 127.0.0.1 (shared memory and
plain TCP); no mocks."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.protocol import DataPlaneError
from dtrain.dataplane.server import ShardServer
from tests.helpers.dataplane import make_shard
from tests.helpers.waiting import wait_until

SECRET = b"d" * 32


def on_loop(loop, coro, timeout=5):  # noqa: F811
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def connect(server, n, shm=False, replica=0):  # noqa: F811
    return SocketShard(server.host, server.port, SECRET, replica=replica, numel=n, timeout=10, shared_memory=shm)



class ContendedLock:
    """The shard's own lock, which also says (``contended``) when a second thread began waiting
    for it: the moment a race under test is set up, instead of a sleep that hopes it is."""

    def __init__(self, lock):
        self._lock = lock
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.contended.set()
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def test_pushes_run_on_the_connection_thread_and_apply_exactly(shm):  # noqa: F811
    """The event loop is never run here: every push is answered anyway, so none went through it
    (without the direct path each would wait for the loop and fail after the server's 2 s), and
    the parameters are exactly the SGD updates in order (0.5 is the learning rate)."""
    stopped = asyncio.new_event_loop()
    shard = make_shard(n=1000)
    server = ShardServer(shard, stopped, SECRET, timeout=2)
    client = connect(server, 1000, shm)
    expected = torch.ones(1000)
    try:
        for k in range(20):
            grad = torch.linspace(-1, 1, 1000) * (k + 1) / 7
            params, step, stop, _ = client.push_pull(grad, 0, k, 0.25, 16, k + 1).result(timeout=5)
            expected.add_(grad, alpha=-0.5)
            assert step == k + 1 and not stop and torch.equal(params, expected)
        assert torch.equal(shard.param, expected) and shard.core.records.samples_total == 20 * 16
        assert shard.core.records.local_steps == {0: 20}
    finally:
        client.close()
        server.close()
        stopped.close()


@pytest.mark.parametrize("how", ["chief", "checkpoint_every"])
def test_a_checkpoint_hold_stops_direct_applies_until_release(loop, how):  # noqa: F811
    """A hold (the chief's, or the one the shard sets itself at a checkpoint_every multiple inside
    a direct apply) makes the next push wait: the parameters and step stay put for the snapshot,
    and the push lands after release. Fails if the direct path ignores hold_at."""
    shard = make_shard(n=64, **({"checkpoint_every": 3} if how == "checkpoint_every" else {}))
    server = ShardServer(shard, loop, SECRET)
    client = connect(server, 64)
    g = torch.ones(64)
    try:
        for k in range(3):
            client.push_pull(g, 0, k).result(timeout=5)
        if how == "chief":
            assert on_loop(loop, shard.hold()) == 3
        assert shard.hold_at == 3
        waiting = client.push_pull(g, 0, 3)
        # The push reaches the shard and waits on the event loop for the release (else: applied).
        wait_until(lambda: shard.waits.waiting == 1 or waiting.done(), 30.0, "the pull waiting", every=0.005)
        assert not waiting.done() and shard.step == 3
        state = on_loop(loop, shard.get_state())
        assert state["step"] == 3 and torch.equal(state["params"], torch.full((64,), 1 - 0.5 * 3))
        on_loop(loop, shard.release())
        params, step, *_ = waiting.result(timeout=5)
        assert step == 4 and torch.equal(params, torch.full((64,), 1 - 0.5 * 4))
        assert client.push_pull(g, 0, 4).result(timeout=5)[1] == 5  # direct again
    finally:
        client.close()
        server.close()


def test_an_event_loop_push_rechecks_a_hold_set_by_a_direct_apply(loop):  # noqa: F811
    """A push on the event loop passed its hold check, then waited for the lock while a direct
    apply on a connection thread reached a checkpoint_every step (held by the test here, which
    sets that hold): once it has the lock it must wait for the release, not apply past the
    checkpoint step. Fails if push_pull does not re-check the hold under the lock."""
    shard = make_shard(n=8)
    shard.waits.lock = lock = ContendedLock(shard.waits.lock)
    with lock:
        pushed = asyncio.run_coroutine_threadsafe(shard.push_pull(torch.ones(8), 0, 0), loop)
        assert lock.contended.wait(30)  # the loop is now blocked on the lock, past _wait_unheld
        shard.core.hold_at = shard.step
    # It must now wait for the release on the event loop (without the re-check it applies at once).
    wait_until(lambda: shard.waits.waiting == 1 or pushed.done(), 30.0, "the push waiting", every=0.005)
    assert not pushed.done() and shard.step == 0 and torch.equal(shard.param, torch.ones(8))
    on_loop(loop, shard.release())
    assert pushed.result(timeout=5)[1] == 1


def test_a_waiting_pull_wakes_after_a_direct_apply(loop):  # noqa: F811
    """A pull(min_step) waits on the event loop's condition; direct applies on a connection thread
    must wake it (else it sleeps through its 30 s barrier timeout)."""
    shard = make_shard(n=64, barrier_timeout_s=30)
    server = ShardServer(shard, loop, SECRET)
    client = connect(server, 64)
    try:
        pulled = asyncio.run_coroutine_threadsafe(shard.pull(2), loop)
        wait_until(lambda: shard.waits.waiting != 0, 5, "the pull waiting", every=0.01)
        assert not pulled.done() and shard.waits.waiting == 1
        for k in range(2):
            client.push_pull(torch.ones(64), 0, k).result(timeout=5)
        params, step, *_ = pulled.result(timeout=2)
        assert step == 2 and torch.equal(params, torch.full((64,), 0.0)) and shard.waits.waiting == 0
    finally:
        client.close()
        server.close()


def test_direct_pushes_are_metered_recorded_and_stop_at_the_last_step(loop):  # noqa: F811
    """The meter, the summary records and the stop at ``steps`` see direct pushes as they see the
    event loop's: fails if the direct path skips the meter, _observe or _after_apply."""
    shard = make_shard(n=64, steps=4, summary_every=2)
    server = ShardServer(shard, loop, SECRET)
    client = connect(server, 64)
    try:
        replies = [client.push_pull(torch.ones(64), 0, 0, 1.5, 8, k + 1).result(timeout=5) for k in range(6)]
        assert [(step, stop) for _, step, stop, _ in replies] == [(1, False), (2, False), (3, False), (4, True),
                                                                  (4, True), (4, True)]
        load = on_loop(loop, shard.load())
        assert load["pushes"] == 4 and load["applies"] == 4 and load["busy_s"] > 0
        assert load["bytes_in"] == 4 * 64 * 4 and load["bytes_out"] == 6 * 64 * 4  # (stopped: reply only)
        assert load["staleness"]["counts"][0] == 1 and sum(load["staleness"]["counts"]) == 4  # versions 0
        stats = on_loop(loop, shard.stats())
        assert [r["step"] for r in stats["records"]] == [2, 4] and stats["records"][0]["loss"] == 1.5
        assert stats["samples"] == 32 and stats["stop"]
    finally:
        client.close()
        server.close()


def test_nan_guard_on_a_direct_push_applies_nothing(loop):  # noqa: F811
    shard = make_shard(n=64, nan_guard=True)
    server = ShardServer(shard, loop, SECRET)
    client = connect(server, 64)
    try:
        client.push_pull(torch.ones(64), 0, 0).result(timeout=5)
        huge = torch.full((64,), 3e38)  # finite, though their sum overflows: applied, no error
        assert client.push_pull(huge, 0, 1).result(timeout=5)[1] == 2 and shard.error is None
        on_loop(loop, shard.set_state({"params": torch.full((64,), 0.5), "step": 1}))
        bad = torch.ones(64)
        bad[7] = float("nan")
        params, step, stop, _ = client.push_pull(bad, 0, 1).result(timeout=5)
        assert step == 1 and stop and torch.equal(params, torch.full((64,), 0.5))
        assert "non-finite gradient" in shard.error
        assert client.push_pull(torch.ones(64), 0, 1).result(timeout=5)[1] == 1  # stopped: nothing more
    finally:
        client.close()
        server.close()


def test_concurrent_direct_pushes_and_checkpoint_reads_stay_consistent(loop, shm):  # noqa: F811
    """Two replicas push at once while the event loop reads states: no update is lost (in-place
    adds racing on two threads would lose some), and every state read is one whole step (a read
    during an apply would mix two). 0.5 * step is exact in float32."""
    n = 1 << 20
    shard = make_shard(n=n)
    server = ShardServer(shard, loop, SECRET)
    clients = [connect(server, n, shm, replica=0), connect(server, n, shm, replica=0)]
    reads: list[tuple[int, bool]] = []
    done = threading.Event()

    def push(c):
        g = torch.ones(n)
        for k in range(60):
            c.push_pull(g, 0, k).result(timeout=10)

    def read():
        while not done.is_set():
            state = on_loop(loop, shard.get_state())
            p = state["params"]
            reads.append((state["step"], bool((p == 1 - 0.5 * state["step"]).all())))
    try:
        reader = threading.Thread(target=read)
        reader.start()
        pushers = [threading.Thread(target=push, args=(c,)) for c in clients]
        [t.start() for t in pushers]
        [t.join(60) for t in pushers]
        done.set()
        reader.join(10)
        assert shard.step == 120 and torch.equal(shard.param, torch.full((n,), 1 - 0.5 * 120))
        assert any(0 < step < 120 for step, _ in reads)  # read while the pushes went on
        assert all(ok for _, ok in reads), [r for r in reads if not r[1]][:3]
    finally:
        for c in clients:
            c.close()
        server.close()


def test_which_shards_push_directly(loop):  # noqa: F811
    """Async pushes go direct unless a staleness gate; sync pushes (ps/sync_push.py) unless the token
    queue; sparse tables go direct too, but their replicas never read the parameters in place;
    each mode only its own op."""
    assert make_shard().direct_pushes and not make_shard().direct_sync
    assert not make_shard(mode="sync").direct_pushes and make_shard(mode="sync").direct_sync
    assert not make_shard(max_staleness=2, replicas=2).direct_pushes  # shard 0: the gate
    assert make_shard(max_staleness=2, holds_global_step=False).direct_pushes  # drop rule only
    table = {"name": "emb", "num_embeddings": 10, "dim": 4, "num_parts": 1, "part": 0, "strategy": "mod",
             "init_std": 0.1, "seed": 0}
    assert make_shard(tables=[table]).direct_pushes
    assert make_shard(mode="sync", tables=[table]).direct_sync
    assert make_shard(mode="sync").shares_params and not make_shard(mode="sync", tables=[table]).shares_params
    assert not make_shard(mode="sync", sync_tokens=True).direct_sync
    stopped = asyncio.new_event_loop()
    shard = make_shard(mode="sync", n=8, sync_tokens=True)
    server = ShardServer(shard, stopped, SECRET, timeout=1)
    client = connect(server, 8)
    try:  # a token push must wait for the loop: never answered by the connection thread
        with pytest.raises(DataPlaneError, match="no result from the ps"):
            client.push_sync(torch.ones(8), 0, 0).result(timeout=5)
        assert shard.core.sync.step == 0
    finally:
        client.close()
        server.close()
        # The given-up push waits in the stopped loop's queue: run it, so that it starts cancelled
        # (closing the loop with it queued would drop its coroutine unawaited).
        for _ in range(2):
            stopped.run_until_complete(asyncio.sleep(0))
        assert not asyncio.all_tasks(stopped)
        stopped.close()
