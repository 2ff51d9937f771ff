"""Sync replies read in place (dataplane/shm.py, ``SharedParams``): the ps's parameters in a memfd
that replicas on its machine map read-only, offered only where no replica can read while the ps
writes (sync, no backup replicas). Real ParameterShards, real ShardServers, real connections on
127.0.0.1; no mocks."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from dtrain.dataplane import shm as transport
from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.server import ShardServer
from tests.helpers.dataplane import HAS_SHM, make_shard

pytestmark = pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")

SECRET = b"p" * 32
LR = 0.5  # make_shard's SGD learning rate


def clients(server, n, replicas, **kw):
    return [SocketShard(server.host, server.port, SECRET, replica=r, numel=n, timeout=10, **kw)
            for r in range(replicas)]


def close(server, cs):
    for c in cs:
        c.close()
    server.close()


def test_sync_replies_point_at_the_ps_parameters_and_no_slot_is_written(loop):  # noqa: F811
    """Every reply of a sync run is the ps's own parameters (exact sync SGD), read through a
    read-only mapping; the replicas' reply slots stay untouched: the ps copied no snapshot."""
    n = 300
    shard = make_shard(mode="sync", n=n, replicas=2)
    server = ShardServer(shard, loop, SECRET, share_params=True)
    cs = clients(server, n, 2)
    expected = torch.ones(n)
    try:
        assert all(c.params is not None for c in cs)
        with pytest.raises(TypeError):  # the replica's mapping cannot write the ps's parameters
            memoryview(cs[0].params._mm)[transport._SHM_HEADER] = 1
        for k in range(5):
            grads = [torch.randn(n, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(2)]
            futs = [cs[r].push_sync(grads[r], r, k, 0.5, 8, k + 1) for r in range(2)]
            expected -= LR * (grads[0] + grads[1]) / 2
            for r, f in enumerate(futs):
                params, step, stop, _ = f.result(timeout=5)
                assert step == k + 1 and not stop
                assert params.data_ptr() == cs[r].params.tensor.data_ptr()
                torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(shard.param, expected, rtol=0, atol=1e-6)
        assert server.in_place_connections == 2  # (counted once the ps read the replica's answer)
        for c in cs:
            assert all(torch.count_nonzero(slot) == 0 for slot in c.shm.param)
        params, step, *_ = cs[0].pull(0).result(timeout=5)  # a pull reads in place too
        assert step == 5 and params.data_ptr() == cs[0].params.tensor.data_ptr()
    finally:
        close(server, cs)


def test_a_model_that_writes_its_parameters_gets_its_own_copy(loop):  # noqa: F811
    """``in_place_views=False`` (a torch module by import path): the reply is copied into the
    replica's own buffer, which it may write; the ps's parameters stay as the ps left them."""
    n = 50
    shard = make_shard(mode="sync", n=n, replicas=1)
    server = ShardServer(shard, loop, SECRET, share_params=True)
    (c,) = cs = clients(server, n, 1, in_place_views=False)
    try:
        assert c.params is not None
        params, step, *_ = c.push_sync(torch.ones(n), 0, 0).result(timeout=5)
        assert step == 1 and params.data_ptr() != c.params.tensor.data_ptr()
        assert torch.equal(params, torch.full((n,), 1 - LR))
        params.fill_(7.0)  # the model writes its copy
        assert torch.equal(shard.param, torch.full((n,), 1 - LR))
    finally:
        close(server, cs)


@pytest.mark.parametrize("case", ["async", "backup", "elastic", "tokens", "off", "no-shm"])
def test_in_place_is_offered_only_where_no_replica_reads_while_the_ps_writes(loop, case):  # noqa: F811
    """Async pushes move the parameters while other replicas compute; a backup replica is still
    reading when the quorum applies; an elastic quorum may leave a replica behind; the token queue
    runs on the event loop. There, and where the run turned shared memory off, every reply is a
    snapshot of its own, as before."""
    n = 20
    kw = {"async": {}, "backup": {"replicas_to_aggregate": 1}, "elastic": {"aggregate_fraction": 0.5},
          "tokens": {"sync_tokens": True, "replicas_to_aggregate": 2}, "off": {}, "no-shm": {}}[case]
    shard = make_shard(mode="async" if case == "async" else "sync", n=n, replicas=2, **kw)
    server = ShardServer(shard, loop, SECRET, share_params=case != "off")
    cs = clients(server, n, 2, shared_memory=case != "no-shm")
    try:
        assert all(c.params is None for c in cs)
        assert server.params is None or case == "no-shm"
        params, step, *_ = cs[0].pull(0).result(timeout=5)
        cs[1].pull(0).result(timeout=5)
        assert server.in_place_connections == 0
        assert step == 0 and torch.equal(params, torch.ones(n))
        assert params.data_ptr() != shard.param.data_ptr()
    finally:
        close(server, cs)


def test_a_replica_that_cannot_map_the_file_gets_snapshots(loop, monkeypatch):  # noqa: F811
    """A replica in another pid namespace (or under ``hidepid``) cannot open the ps's memfd: it
    answers 0 and its replies come through its reply slots, while a replica that could map it
    reads in place; both see the same parameters."""
    n = 40
    shard = make_shard(mode="sync", n=n, replicas=2)
    server = ShardServer(shard, loop, SECRET, share_params=True)
    (a,) = clients(server, n, 1)
    monkeypatch.setattr(transport.SharedParams, "attach", classmethod(lambda cls, *args: None))
    b = SocketShard(server.host, server.port, SECRET, replica=1, numel=n, timeout=10)
    cs = [a, b]
    try:
        assert a.params is not None and b.params is None and b.shm is not None
        fa, fb = a.push_sync(torch.ones(n), 0, 0), b.push_sync(torch.ones(n) * 3, 1, 0)
        pa, pb = fa.result(timeout=5)[0], fb.result(timeout=5)[0]
        assert server.in_place_connections == 1 and server.shared_connections == 2
        assert pb.data_ptr() in {s.data_ptr() for s in b.shm.param}
        assert torch.equal(pa, pb) and torch.equal(pb, torch.full((n,), 1 - LR * 2.0))
    finally:
        close(server, cs)


def test_the_ps_keeps_its_parameters_after_the_server_closes(loop):  # noqa: F811
    """Closing the data plane closes the memfd (no replica attaches any more) but the shard's
    parameters stay where they are, and a new server serves them again."""
    n = 30
    shard = make_shard(mode="sync", n=n, replicas=1)
    server = ShardServer(shard, loop, SECRET, share_params=True)
    (c,) = clients(server, n, 1)
    c.push_sync(torch.ones(n), 0, 0).result(timeout=5)
    c.close()
    server.close()
    assert server.params.fd == -1 and torch.equal(shard.param, torch.full((n,), 1 - LR))
    again = ShardServer(shard, loop, SECRET, share_params=True)
    cs = clients(again, n, 1)
    try:
        params, step, *_ = cs[0].pull(0).result(timeout=5)
        assert step == 1 and torch.equal(params, torch.full((n,), 1 - LR))
        assert again.in_place_connections == 1 and params.data_ptr() == cs[0].params.tensor.data_ptr()
        assert asyncio.run_coroutine_threadsafe(shard.current_step(), loop).result(5) == 1
    finally:
        close(again, cs)


def test_attach_checks_the_token_and_the_shard_size():
    """The replica maps the file only if it is the one the ps named: its token, and the shard's
    number of floats (the file's size alone is rounded up to a page)."""
    ps = transport.SharedParams.create(1000)
    try:
        ps.tensor.fill_(2.0)
        ok = transport.SharedParams.attach(os.getpid(), ps.fd, ps.token, 1000)
        assert ok is not None and torch.equal(ok.tensor, torch.full((1000,), 2.0))
        assert transport.SharedParams.attach(os.getpid(), ps.fd, b"x" * 16, 1000) is None
        assert transport.SharedParams.attach(os.getpid(), ps.fd, ps.token, 999) is None
        assert transport.SharedParams.attach(os.getpid(), 10**6, ps.token, 1000) is None  # no such fd
    finally:
        ps.close()
