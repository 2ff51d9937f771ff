"""The socket data plane under abuse and faults (reliability review M3, M4, M5, M14, M16, L1): a
real ShardServer and ParameterShard on 127.0.0.1, raw sockets for bad bytes, monkeypatched OS
calls for injected errors."""

from __future__ import annotations

import errno
import hashlib
import hmac
import socket
import struct
import threading
import time

import pytest
import torch

from dtrain.dataplane import protocol as proto
from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.protocol import MAGIC, REP, REQ, DataPlaneError
from dtrain.dataplane.server import ShardServer

from .test_transport import loop, make_shard, shm  # noqa: F401  (fixtures)

SECRET = b"a" * 32


def raw_client(server: ShardServer, secret: bytes = SECRET, replica: int = 0, attempt: int = 0) -> socket.socket:
    """A raw socket past the handshake (no shared-memory offer), to send hand-made headers."""
    s = socket.create_connection((server.host, server.port), timeout=10)
    hello = proto.recv_bytes(s, len(MAGIC) + 16)
    assert hello[:len(MAGIC)] == MAGIC
    digest = hmac.new(secret, hello[len(MAGIC):], hashlib.sha256).digest()
    s.sendall(digest + struct.pack("<IIH", replica, attempt, 0))
    assert proto.recv_bytes(s, 1) == b"\x01"
    return s


def request(s: socket.socket, op: int, flags: int = 0, replica: int = 0, offset: int = 0, nbytes: int = 0,
            payload: bytes = b"") -> tuple[int, bytes]:
    """Send one header (and payload); return the reply's (error flag, message or parameter bytes)."""
    s.sendall(REQ.pack(op, flags, 0, replica, 0, 1, 0.5, 4, offset, nbytes) + payload)
    _step, _stop, error, _pad, _gen, n = REP.unpack(proto.recv_bytes(s, REP.size))
    return error, proto.recv_bytes(s, n)


def closed_by_server(s: socket.socket, within: float = 5.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


# ------------------------------------------------------------------ M4: the listener survives


def test_accept_survives_transient_errors(loop, monkeypatch):  # noqa: F811
    """EMFILE from accept() once: the listener logs, waits briefly and serves the next client
    (it used to return, leaving connections in the backlog forever)."""
    real_accept = socket.socket.accept
    failures = []

    def flaky_accept(self):
        if self.getsockname()[1] == getattr(flaky_accept, "port", None) and not failures:
            failures.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    shard = make_shard(n=10)
    monkeypatch.setattr(socket.socket, "accept", flaky_accept)
    server = ShardServer(shard, loop, SECRET)
    flaky_accept.port = server.port
    try:
        client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
        assert failures == [1]
        assert client.pull(0).result(5)[1] == 0
        client.close()
    finally:
        server.close()


def test_thread_start_failure_drops_only_that_connection(loop, monkeypatch):  # noqa: F811
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, SECRET)
    real_start = threading.Thread.start
    failed = []

    def start(self):
        if self.name.endswith("-conn") and not failed:
            failed.append(1)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        with pytest.raises(DataPlaneError):
            SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
        client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
        assert failed == [1] and client.pull(0).result(5)[1] == 0
        client.close()
    finally:
        server.close()


# ------------------------------------------------------------------ M3: no idle drop


def test_idle_authenticated_connection_is_kept(loop, shm):  # noqa: F811
    """A replica that loads its data (or runs a long step) longer than the server's timeout keeps
    its connection: the next pull is served (it got "connection closed by the peer" before)."""
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, SECRET, timeout=0.5)
    client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=shm)
    try:
        time.sleep(1.5)
        assert client.pull(0).result(5)[1] == 0
        assert client.push_pull(torch.ones(10), 0, 0, 0.1, 4, 1).result(5)[1] == 1
    finally:
        client.close()
        server.close()
