"""The socket data plane without a cluster: a real ParameterShard on a real event loop thread,
real TCP connections on 127.0.0.1, with and without the shared-memory slots."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from dtrain.dataplane import shm as transport
from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.protocol import MAGIC, DataPlaneError
from dtrain.dataplane.server import ShardServer
from dtrain.dataplane.shm import SharedSlots
from tests.helpers.dataplane import HAS_SHM, make_shard
from tests.helpers.paths import ROOT


def dtrain_shm_files() -> set[str]:
    return {n for n in os.listdir(transport.SHM_DIR) if n.startswith("dtrain-")} if HAS_SHM else set()


def test_push_pull_roundtrip_applies_the_gradient(loop, shm):
    shard = make_shard()
    server = ShardServer(shard, loop, b"s" * 32)
    client = SocketShard(server.host, server.port, b"s" * 32, replica=0, numel=1000, timeout=5,
                         shared_memory=shm)
    try:
        assert (client.shm is not None) == shm and server.shared_connections == int(shm)
        params, step, stop, gen = client.pull(0).result(timeout=5)
        assert step == 0 and torch.equal(params, torch.ones(1000))
        grad = torch.full((1000,), 2.0)
        params, step, stop, gen = client.push_pull(grad, 0, 0, 0.7, 32, 1).result(timeout=5)
        assert step == 1 and not stop
        assert torch.allclose(params, torch.zeros(1000))  # 1 - 0.5 * 2
        assert shard.core.records.samples_total == 32
        # the same numbers the actor path (the shard's coroutine on its event loop) computes
        other = make_shard()
        actor = asyncio.run_coroutine_threadsafe(other.push_pull(grad, 0, 0, 0.7, 32, 1), loop).result(5)
        assert actor[1] == 1 and torch.equal(actor[0], params)
    finally:
        client.close()
        server.close()


def test_sync_barrier_over_sockets(loop, shm):
    shard = make_shard(mode="sync", n=10, replicas=2, replicas_to_aggregate=2)
    server = ShardServer(shard, loop, b"k" * 32)
    a = SocketShard(server.host, server.port, b"k" * 32, replica=0, numel=10, timeout=5, shared_memory=shm)
    b = SocketShard(server.host, server.port, b"k" * 32, replica=1, numel=10, timeout=5, shared_memory=shm)
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
        before = dtrain_shm_files()
        for shared_memory in (True, False):
            with pytest.raises(DataPlaneError, match="refused the data-plane handshake"):
                SocketShard(server.host, server.port, b"wrong" * 8, replica=0, numel=1000, timeout=5,
                            shared_memory=shared_memory)
        assert shard.step == 0 and server.shared_connections == 0  # nothing applied, nothing mapped
        assert dtrain_shm_files() == before
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
    assert MAGIC == b"DTRN6"  # bumped with each change a peer of another version would misread (the attempt
    # id; TLS ending for shared memory; answer 3, the parameters read in place; the sparse block's head first)


def test_ps_error_travels_back(loop, shm):
    shard = make_shard(n=10, barrier_timeout_s=0.5)
    server = ShardServer(shard, loop, b"e" * 32)
    client = SocketShard(server.host, server.port, b"e" * 32, replica=0, numel=10, timeout=30, shared_memory=shm)
    try:
        with pytest.raises(DataPlaneError, match="BarrierTimeout|waited"):
            client.pull(5).result(timeout=30)  # the shard never reaches step 5: its 0.5 s barrier times out
    finally:
        client.close()
        server.close()


def test_bfloat16_wire_halves_bytes_and_rounds_like_bfloat16(loop, shm):
    shard = make_shard(n=1000)
    server = ShardServer(shard, loop, b"b" * 32, wire_dtype="bfloat16")
    client = SocketShard(server.host, server.port, b"b" * 32, replica=0, numel=1000, timeout=5,
                         wire_dtype="bfloat16", shared_memory=shm)
    try:
        assert (client.shm is not None) == shm and client.grad_slots() is None  # bf16 slots: no zero-copy
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


@pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")
def test_shared_memory_slots_zero_copy_and_nothing_left_in_dev_shm(loop):
    """Backward can write straight into a gradient slot: pushing the slot itself sends only a
    header, and the reply is a view of a parameter slot (alternating, so the one the model is
    using is never overwritten). The file is unlinked once both sides have mapped it."""
    before = dtrain_shm_files()
    shard = make_shard(n=1000)
    server = ShardServer(shard, loop, b"z" * 32)
    client = SocketShard(server.host, server.port, b"z" * 32, replica=0, numel=1000, timeout=5)
    try:
        assert dtrain_shm_files() == before  # unlinked after the handshake
        slots = client.grad_slots()
        assert slots is not None and len(slots) == 2
        p0, *_ = client.pull(0).result(timeout=5)
        slots[1].fill_(1.0)
        p1, step, *_ = client.push_pull(slots[1], 0, 0, 0.3, 8, 1).result(timeout=5)
        assert step == 1 and torch.allclose(p1, torch.full((1000,), 0.5))
        assert p1.data_ptr() != p0.data_ptr() and torch.equal(p0, torch.ones(1000))  # p0 untouched
        assert p1.data_ptr() in {t.data_ptr() for t in client.shm.param}
        # a gradient that is not a slot is copied into one
        p2, step, *_ = client.push_pull(torch.full((1000,), 1.0), 0, 1, 0.3, 8, 2).result(timeout=5)
        assert step == 2 and torch.allclose(p2, torch.zeros(1000)) and p2.data_ptr() == p0.data_ptr()
    finally:
        client.close()
        server.close()
    assert dtrain_shm_files() == before


@pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")
def test_shared_memory_refused_falls_back_to_the_socket(loop, monkeypatch):
    """A ps that cannot map the replica's file (another machine, another /dev/shm: simulated by an
    attach that finds nothing) answers 1 and the connection carries the bytes instead."""
    shard = make_shard(n=100)
    server = ShardServer(shard, loop, b"f" * 32)
    before = dtrain_shm_files()
    monkeypatch.setattr(SharedSlots, "attach", classmethod(lambda cls, *a: None))
    client = SocketShard(server.host, server.port, b"f" * 32, replica=0, numel=100, timeout=5)
    try:
        assert client.shm is None and server.shared_connections == 0 and client.grad_slots() is None
        assert dtrain_shm_files() == before
        params, step, *_ = client.push_pull(torch.full((100,), 2.0), 0, 0, 0.1, 4, 1).result(timeout=5)
        assert step == 1 and torch.allclose(params, torch.zeros(100))
    finally:
        client.close()
        server.close()


@pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")
def test_attach_checks_name_size_and_token():
    created = SharedSlots.create(64, torch.float32)
    assert created is not None
    slots, name, token = created
    path = os.path.join(transport.SHM_DIR, name)
    try:
        assert SharedSlots.attach("../etc/passwd", token, 64, torch.float32) is None
        assert SharedSlots.attach(name, b"x" * 16, 64, torch.float32) is None  # wrong token
        assert not os.path.exists(path)  # attach unlinks what it opened, mapped or not
    finally:
        slots.close()
        transport.unlink(path)


@pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")
def test_closing_the_slots_keeps_the_memory_a_model_still_views():
    """``SharedSlots.close`` on a side whose model still views a slot (the replica's parameters and
    gradients are views into them) must not unmap that memory: a later use would crash the process.
    Run in a child, where that crash is an exit status instead of the test run's end (fails with
    -11, SIGSEGV, if close unmaps, as it did with ``mmap.close``: torch's views do not pin it)."""
    code = ("import gc, os, torch\n"
            "from dtrain.dataplane.shm import SHM_DIR, SharedSlots, unlink\n"
            "slots, name, _ = SharedSlots.create(1 << 20, torch.float32)\n"
            "unlink(os.path.join(SHM_DIR, name))\n"
            "grad, param = slots.grad[0].view(1024, 1024), slots.param[1]\n"
            "slots.close(); gc.collect()\n"
            "grad.fill_(2.0); param.fill_(3.0)\n"
            "print(float(grad.sum() + param.sum()), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert float(proc.stdout) == 5.0 * (1 << 20)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_parts_then_head_deliver_the_whole_gradient(loop, wire):
    """Buckets sent during backward (send_part) plus the head sent by the push are one gradient."""
    shard = make_shard(n=1000)
    server = ShardServer(shard, loop, b"p" * 32, wire_dtype=wire)
    client = SocketShard(server.host, server.port, b"p" * 32, replica=0, numel=1000, timeout=5,
                         wire_dtype=wire, shared_memory=False)
    try:
        assert client.sends_parts
        grad = torch.linspace(-1, 1, 1000)
        client.send_part(grad, 600, 1000)
        client.send_part(grad, 250, 600)
        params, step, *_ = client.push_pull(grad, 0, 0, 0.1, 8, 1, head=250).result(timeout=5)
        sent = grad if wire == "float32" else grad.to(torch.bfloat16).float()
        assert step == 1 and torch.equal(shard.param, torch.ones(1000) - 0.5 * sent)
        # the next push without parts sends all of it again
        client.push_pull(torch.zeros(1000), 0, 1, 0.1, 8, 2).result(timeout=5)
        assert torch.equal(shard.param, torch.ones(1000) - 0.5 * sent)
    finally:
        client.close()
        server.close()


@pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm on this machine")
def test_shared_memory_connections_send_no_parts(loop):
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, b"q" * 32)
    client = SocketShard(server.host, server.port, b"q" * 32, replica=0, numel=10, timeout=5)
    try:
        assert client.shm is not None and not client.sends_parts
    finally:
        client.close()
        server.close()
