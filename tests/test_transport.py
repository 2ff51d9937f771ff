"""The socket data plane without a cluster: a real ParameterShard on a real event loop thread,
real TCP connections on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch

from dtrain.ps import ParameterShard
from dtrain.transport import MAGIC, DataPlaneError, ShardServer, SocketShard


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


def make_shard(mode="async", n=1000, replicas=1, **kw):
    config = {"index": 0, "mode": mode, "steps": 10_000, "num_replicas": replicas,
              "optimizer": {"name": "sgd", "lr": 0.5}, "barrier_timeout_s": 5, **kw}
    return ParameterShard(config, torch.ones(n))


def test_push_pull_roundtrip_applies_the_gradient(loop):
    shard = make_shard()
    server = ShardServer(shard, loop, b"s" * 32)
    client = SocketShard(server.host, server.port, b"s" * 32, replica=0, numel=1000, timeout=5)
    try:
        params, step, stop, gen = client.pull(0).result(timeout=5)
        assert step == 0 and torch.equal(params, torch.ones(1000))
        grad = torch.full((1000,), 2.0)
        params, step, stop, gen = client.push_pull(grad, 0, 0, 0.7, 32, 1).result(timeout=5)
        assert step == 1 and not stop
        assert torch.allclose(params, torch.zeros(1000))  # 1 - 0.5 * 2
        assert shard.samples_total == 32
        # the same numbers the actor path computes
        assert torch.equal(shard.param, params)
    finally:
        client.close()
        server.close()


def test_sync_barrier_over_sockets(loop):
    shard = make_shard(mode="sync", n=10, replicas=2, replicas_to_aggregate=2)
    server = ShardServer(shard, loop, b"k" * 32)
    a = SocketShard(server.host, server.port, b"k" * 32, replica=0, numel=10, timeout=5)
    b = SocketShard(server.host, server.port, b"k" * 32, replica=1, numel=10, timeout=5)
    try:
        fa = a.push_sync(torch.full((10,), 1.0), 0, 0, 1.0, 4, 1)
        fb = b.push_sync(torch.full((10,), 3.0), 1, 0, 1.0, 4, 1)
        (pa, sa, *_), (pb, sb, *_) = fa.result(timeout=5), fb.result(timeout=5)
        assert sa == sb == 1
        assert torch.allclose(pa, torch.full((10,), 1 - 0.5 * 2.0)) and torch.equal(pa, pb)
        # a gradient for step 0 is now stale: dropped and counted, parameters unchanged
        pc, sc, *_ = a.push_sync(torch.full((10,), 100.0), 0, 0, 1.0, 4, 2).result(timeout=5)
        assert sc == 1 and torch.equal(pc, pa) and shard.dropped_stale == 1
    finally:
        a.close()
        b.close()
        server.close()


def test_wrong_secret_is_refused(loop):
    shard = make_shard()
    server = ShardServer(shard, loop, b"right" * 8)
    try:
        client = SocketShard(server.host, server.port, b"wrong" * 8, replica=0, numel=1000, timeout=5)
        with pytest.raises(DataPlaneError):
            client.push_pull(torch.ones(1000), 0, 0, 0.1, 1, 1).result(timeout=5)
        client.close()
        assert shard.step == 0  # nothing was applied
    finally:
        server.close()


def test_not_a_data_plane_is_detected():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def answer():
        conn, _ = srv.accept()
        conn.sendall(b"HTTP/1.1 400 Bad\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    with pytest.raises(DataPlaneError, match="not a dtrain ps data plane"):
        SocketShard("127.0.0.1", port, b"x" * 32, replica=0, numel=4, timeout=5)
    t.join(5)
    srv.close()
    assert MAGIC == b"DTRN1"


def test_ps_error_travels_back(loop):
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, b"e" * 32)
    client = SocketShard(server.host, server.port, b"e" * 32, replica=0, numel=10, timeout=30)
    try:
        with pytest.raises(DataPlaneError, match="BarrierTimeout|waited"):
            client.pull(5).result(timeout=30)  # the shard never reaches step 5: its 5 s barrier times out
    finally:
        client.close()
        server.close()


def test_bfloat16_wire_halves_bytes_and_rounds_like_bfloat16(loop):
    shard = make_shard(n=1000)
    server = ShardServer(shard, loop, b"b" * 32, wire_dtype="bfloat16")
    client = SocketShard(server.host, server.port, b"b" * 32, replica=0, numel=1000, timeout=5,
                         wire_dtype="bfloat16")
    try:
        grad = torch.linspace(-1, 1, 1000)
        params, step, *_ = client.push_pull(grad, 0, 0, 0.1, 8, 1).result(timeout=5)
        assert step == 1 and params.dtype == torch.float32
        # the ps applied the bfloat16-rounded gradient in float32, and replied in bfloat16
        expected = (torch.ones(1000) - 0.5 * grad.to(torch.bfloat16).float()).to(torch.bfloat16).float()
        assert torch.equal(params, expected)
        assert torch.equal(shard.param, torch.ones(1000) - 0.5 * grad.to(torch.bfloat16).float())
    finally:
        client.close()
        server.close()
