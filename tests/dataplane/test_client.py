"""The replica's handle (dataplane/client.py): on a shared-memory connection requests are sent on
the caller's thread and their replies read when asked for (``InlineReply``); on a socket's bytes
a background thread runs them. Real shards, servers and connections on 127.0.0.1; no mocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dtrain.dataplane.client import InlineReply, SocketShard
from dtrain.dataplane.protocol import DataPlaneError
from dtrain.dataplane.server import ShardServer
from tests.helpers.dataplane import HAS_SHM, make_shard

SECRET = b"c" * 32
pytestmark = pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")


def connect(server, n, replica=0, shm=True):
    return SocketShard(server.host, server.port, SECRET, replica=replica, numel=n, timeout=10, shared_memory=shm)


def test_shared_memory_requests_run_on_the_callers_thread_socket_bytes_on_the_pool(loop):  # noqa: F811
    """No thread besides the caller's takes part in a shared-memory round trip (the pool never
    starts one); a socket connection's requests are Futures of its background thread."""
    shard = make_shard(n=64)
    server = ShardServer(shard, loop, SECRET)
    inline, pooled = connect(server, 64), connect(server, 64, shm=False)
    try:
        for k in range(5):
            reply = inline.push_pull(torch.ones(64), 0, k)
            assert isinstance(reply, InlineReply)
            params, step, *_ = reply.result(5)
            assert step == k + 1 and torch.equal(params, torch.full((64,), 1 - 0.5 * (k + 1)))
        assert not inline._pool._threads
        fut = pooled.pull(0)
        assert not isinstance(fut, InlineReply) and fut.result(5)[1] == 5 and len(pooled._pool._threads) == 1
    finally:
        inline.close()
        pooled.close()
        server.close()


def test_a_short_result_timeout_leaves_the_reply_to_a_later_read(loop):  # noqa: F811
    """A sync push waiting at the barrier: ``result(0.2)`` times out without consuming anything,
    ``done()`` stays False, and once the other replica pushes the same object gives the reply."""
    shard = make_shard(mode="sync", n=8, replicas=2)
    server = ShardServer(shard, loop, SECRET)
    a, b = connect(server, 8), connect(server, 8, replica=1)
    try:
        waiting = a.push_sync(torch.ones(8), 0, 0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            waiting.result(timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5 and not waiting.done()  # (its own 0.2 s, not the 10 s connection's)
        b.push_sync(torch.ones(8) * 3, 1, 0).result(5)
        params, step, *_ = waiting.result(5)
        assert step == 1 and torch.equal(params, torch.full((8,), 1 - 0.5 * 2.0))
        assert waiting.done() and waiting.exception() is None
    finally:
        a.close()
        b.close()
        server.close()


def test_a_new_request_reads_the_unread_reply_first(loop):  # noqa: F811
    """Replies come back in order on one connection: a request sent while the previous reply is
    unread first reads it into its own object, so each caller gets its own step."""
    shard = make_shard(n=16)
    server = ShardServer(shard, loop, SECRET)
    c = connect(server, 16)
    try:
        first = c.push_pull(torch.ones(16), 0, 0)
        second = c.push_pull(torch.ones(16), 0, 1)
        assert second.result(5)[1] == 2  # (asked for first: the first reply was read already)
        assert first.done() and first.result(5)[1] == 1
        assert c.pull(0).result(5)[1] == 2
    finally:
        c.close()
        server.close()


def test_errors_reach_the_caller_from_the_inline_path(loop):  # noqa: F811
    """The ps's error reply and a closed connection raise DataPlaneError from ``result``, as the
    background thread's Futures do."""
    shard = make_shard(n=8, nan_guard=True)
    server = ShardServer(shard, loop, SECRET)
    c = connect(server, 8)
    try:
        _params, _step, stop, _ = c.push_pull(torch.full((8,), float("nan")), 0, 0).result(5)
        assert stop and "non-finite" in shard.error
        server.close()
        time.sleep(0.1)
        reply = c.push_pull(torch.ones(8), 0, 1)
        with pytest.raises(DataPlaneError):
            reply.result(5)
        assert isinstance(reply.exception(), DataPlaneError)
    finally:
        c.close()
        server.close()


def test_replicas_on_threads_keep_their_own_connections(loop):  # noqa: F811
    """Two replicas' handles used from two threads at once (as two tower actors on one worker):
    all 2 x 50 pushes applied, none lost or answered twice."""
    shard = make_shard(n=32, replicas=2)
    server = ShardServer(shard, loop, SECRET)
    cs = [connect(server, 32, replica=r) for r in range(2)]
    steps: list[list[int]] = [[], []]

    def run(r):
        for k in range(50):
            steps[r].append(cs[r].push_pull(torch.ones(32), r, k).result(5)[1])

    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert shard.step == 100 and sorted(steps[0] + steps[1]) == list(range(1, 101))
    finally:
        for c in cs:
            c.close()
        server.close()
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_tls_ends_after_the_handshake_only_where_shared_memory_carries_the_bytes(loop, shm):  # noqa: F811
    """On a TLS data plane a shared-memory connection goes on in the clear after the handshake
    (both sides unwrapped: only headers cross, between two processes of one machine); a
    connection whose bytes cross the socket stays TLS. Round trips work either way."""
    from distributed import Security

    from dtrain.dataplane.protocol import client_ssl_context, server_ssl_context
    from dtrain.worker.tasks import tls_pems

    pems = tls_pems(Security.temporary())
    shard = make_shard(n=32)
    server = ShardServer(shard, loop, SECRET, ssl_context=server_ssl_context(pems))
    c = SocketShard(server.host, server.port, SECRET, replica=0, numel=32, timeout=10, shared_memory=shm,
                    ssl_context=client_ssl_context(pems))
    try:
        assert (c.shm is not None) == shm
        for k in range(3):
            params, step, *_ = c.push_pull(torch.ones(32), 0, k).result(5)
            assert step == k + 1 and torch.equal(params, torch.full((32,), 1 - 0.5 * (k + 1)))
        assert (c._sock.version() is None) == shm  # (an SSLSocket's TLS version: None once unwrapped)
        (conn,) = server._conns
        assert (conn.version() is None) == shm
    finally:
        c.close()
        server.close()
