"""The socket data plane under abuse and faults (reliability review M3, M4, M5, M14, M16, L1): a
real ShardServer and ParameterShard on 127.0.0.1, raw sockets for bad bytes, monkeypatched OS
calls for injected errors."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from dtrain.dataplane import protocol as proto
from dtrain.dataplane import server as server_mod
from dtrain.dataplane import shm as shm_mod
from dtrain.dataplane.client import SocketShard
from dtrain.dataplane.protocol import MAGIC, REP, REQ, DataPlaneError, DataPlaneUnavailable
from dtrain.dataplane.server import ShardServer
from dtrain.dataplane.shm import F_SHM
from tests.helpers.dataplane import make_shard
from tests.helpers.waiting import wait_until

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
    except ConnectionResetError:  # closed with our unread payload in its buffer: a reset
        return True
    except TimeoutError:
        return False


def drip_until_closed(s: socket.socket, limit: float = 6.0) -> float:
    """Send one byte every 0.3 s until the server closes ``s``; the seconds it took (inf: never)."""
    s.settimeout(0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            s.sendall(b"\x01")
            if s.recv(1) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0
    return float("inf")


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


# ------------------------------------------------------------------ L1: every header field checked


def test_misaligned_gradient_bytes_are_refused(loop):  # noqa: F811
    """offset 1 / 5 bytes of a float32 shard used to be accepted (the check divided by the byte
    view's itemsize, 1) and wrote across float boundaries."""
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, SECRET)
    try:
        for offset, nbytes in ((1, 4), (0, 5), (4, 44)):
            s = raw_client(server)
            error, msg = request(s, proto.OP_PUSH_PULL, offset=offset, nbytes=nbytes, payload=b"\x7f" * nbytes)
            assert error == 1 and b"not whole 4-byte values inside a shard of 40 bytes" in msg, msg
            assert closed_by_server(s)
            s.close()
        assert shard.step == 0 and torch.equal(shard.param, torch.ones(10))
    finally:
        server.close()


@pytest.mark.parametrize("op,flags,replica,expected", [
    (9, 0, 0, b"unknown op 9"),
    (0, 0, 0, b"unknown op 0"),
    (proto.OP_PART, F_SHM, 0, b"shared-memory request"),
    (proto.OP_PUSH_PULL, F_SHM, 0, b"without shared memory"),
    (proto.OP_PUSH_PULL, 0, 10**9, b"replica 1000000000 of a run with 2 replicas"),
    (proto.OP_PUSH_SYNC, 0, 2, b"replica 2 of a run with 2 replicas"),
])
def test_bad_header_fields_get_an_error_reply(loop, op, flags, replica, expected):  # noqa: F811
    """Each bad field is answered with an error (the connection then closed), never a silent
    drop (an unknown op was a KeyError) and never applied (a huge replica index grew the
    shard's per-replica dicts)."""
    shard = make_shard(n=10, replicas=2)
    server = ShardServer(shard, loop, SECRET)
    try:
        s = raw_client(server)
        error, msg = request(s, op, flags=flags, replica=replica)
        assert error == 1 and expected in msg, msg
        assert closed_by_server(s)
        s.close()
        assert shard.step == 0 and shard.core.records.local_steps == {}
        client = SocketShard(server.host, server.port, SECRET, replica=1, numel=10, timeout=5, shared_memory=False)
        assert client.push_pull(torch.ones(10), 1, 0, 0.1, 4, 1).result(5)[1] == 1  # the ps still serves
        client.close()
    finally:
        server.close()


def fake_ps(reply: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A server that accepts one client's handshake, then sends ``reply`` to its first request
    (or nothing: None)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        conn.sendall(MAGIC + b"n" * 16)
        proto.recv_bytes(conn, 32 + 4 + 4 + 2)
        conn.sendall(b"\x01")
        proto.recv_bytes(conn, REQ.size)
        if reply is not None:
            conn.sendall(reply)
        time.sleep(3)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("reply,timeout,expected", [
    (REP.pack(0, 1, 1, 0, 0, 2**40), 5, "error reply of 1099511627776 bytes"),
    (None, 1, "no answer from the ps in 1 s"),
], ids=["huge-error-length", "silent"])
def test_a_bad_or_silent_ps_reads_clearly(reply, timeout, expected):
    """A server (unauthenticated: the client does not check it) naming a 1 TiB error message
    gets a clear error, nothing allocated; a silent one: SO_RCVTIMEO expiry is EAGAIN
    (BlockingIOError), not TimeoutError, and must read "no answer from the ps in N s"."""
    srv, t = fake_ps(reply)
    client = SocketShard("127.0.0.1", srv.getsockname()[1], SECRET, replica=0, numel=4, timeout=timeout,
                         shared_memory=False)
    try:
        with pytest.raises(DataPlaneError, match=expected) as raised:
            client.pull(0).result(5)
        # A silent ps may come back (the session retries: TF's Unavailable); a malformed reply not.
        assert isinstance(raised.value, DataPlaneUnavailable) == (reply is None)
    finally:
        client.close()
        srv.close()


def test_a_silent_ps_reads_as_no_answer_in_the_handshake():
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never says a word
    try:
        with pytest.raises(DataPlaneUnavailable, match="no answer in 1 s"):
            SocketShard("127.0.0.1", mute.getsockname()[1], SECRET, replica=0, numel=4, timeout=1)
    finally:
        mute.close()


# ------------------------------------------------------------------ M5: pre-authentication limits


def test_handshake_has_an_absolute_deadline(loop):  # noqa: F811
    """One byte every 0.3 s used to restart the per-read timeout forever; the handshake now ends
    at its deadline however the bytes trickle in."""
    server = ShardServer(make_shard(n=10), loop, SECRET, timeout=5, handshake_timeout=1)
    s = socket.create_connection((server.host, server.port), timeout=5)
    try:
        assert proto.recv_bytes(s, len(MAGIC) + 16)[:len(MAGIC)] == MAGIC
        assert drip_until_closed(s) < 5  # its 1 s deadline, with room for a loaded machine (never: inf)
    finally:
        s.close()
        server.close()


def test_unauthenticated_connections_are_capped(loop, caplog):  # noqa: F811
    """200 silent connections hold at most MAX_PENDING threads (the rest are closed at once), one
    WARNING covers the refusals, and once the deadline cuts the silent ones a replica connects
    even while all 200 sockets are still open on the attacker's side."""
    server = ShardServer(make_shard(n=10), loop, SECRET, timeout=5, handshake_timeout=1.5)
    before = threading.active_count()
    silent = []
    try:
        for _ in range(200):
            silent.append(socket.create_connection((server.host, server.port), timeout=5))
        time.sleep(0.5)
        assert threading.active_count() - before <= server_mod.MAX_PENDING
        time.sleep(1.5)  # past the deadline: the pending ones were cut
        client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
        assert client.pull(0).result(5)[1] == 0
        client.close()
        refusals = [r for r in caplog.records if "connection(s) refused" in r.getMessage()]
        assert 1 <= len(refusals) <= 2  # rate-limited: not one line per connection
    finally:
        for s in silent:
            s.close()
        server.close()


def ended(s: socket.socket, within: float = 5.0) -> bool:
    """The server closed ``s`` (what it sent first, its challenge, read and dropped)."""
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def test_silent_connections_at_the_cap_cannot_lock_a_replica_out(loop):  # noqa: F811
    """MAX_PENDING silent connections kept open within their handshake deadline made the server
    close every new connection at once, so a replica that connected then (its start, a recovery,
    an elastic join) failed. The oldest handshake now gives way to the newest connection."""
    server = ShardServer(make_shard(n=10), loop, SECRET, timeout=30, handshake_timeout=30)
    silent = []
    try:
        for _ in range(server_mod.MAX_PENDING):
            silent.append(socket.create_connection((server.host, server.port), timeout=5))
        for i in range(3):
            time.sleep(0.3)  # every silent one in its handshake: the cap is reached
            client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5,
                                 shared_memory=False)
            assert client.pull(0).result(5)[1] == 0
            client.close()
            assert ended(silent[i])  # the oldest went
            assert not ended(silent[i + 1], within=0.1)  # the others still wait (their deadline: 30 s)
            silent.append(socket.create_connection((server.host, server.port), timeout=5))  # the cap again
    finally:
        for s in silent:
            s.close()
        server.close()


def test_closed_connections_leave_the_server_list(loop):  # noqa: F811
    server = ShardServer(make_shard(n=10), loop, SECRET, timeout=5)
    try:
        for i in range(50):
            if i % 2:
                socket.create_connection((server.host, server.port), timeout=5).close()
            else:
                SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5,
                            shared_memory=False).close()
        wait_until(lambda: not (server._conns or server._pending), 5, "every connection closed")
        assert not server._conns and not server._pending and server.connections == 25
    finally:
        server.close()


# ------------------------------------------------------------------ M14: the barrier grace


def on_loop(loop, coro):  # noqa: F811
    return asyncio.run_coroutine_threadsafe(coro, loop).result(5)


def test_requests_wait_through_the_barrier_grace(loop):  # noqa: F811
    """A lost replica is being restarted: the session granted a 10 s grace. A lone sync push must
    wait past the server's 2 s timeout until the replacement pushes 2.5 s after it (it used to get
    "TimeoutError" from the server at 2 s, failing the recovery the grace was for)."""
    shard = make_shard(mode="sync", n=10, replicas=2, replicas_to_aggregate=2, barrier_timeout_s=1)
    server = ShardServer(shard, loop, SECRET, timeout=2)
    a = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=10, shared_memory=False)
    b = SocketShard(server.host, server.port, SECRET, replica=1, numel=10, timeout=10, shared_memory=False)
    try:
        on_loop(loop, shard.barrier_grace(10))
        fa = a.push_sync(torch.ones(10), 0, 0, 1.0, 4, 1)
        wait_until(lambda: shard.meter.pushes >= 1, 30, "the push in", every=0.005)  # waiting at the barrier
        pushed = time.monotonic()
        while time.monotonic() < pushed + 2.5:  # past the server's 2 s timeout, inside the grace
            assert not fa.done()
            time.sleep(0.05)
        fb = b.push_sync(torch.ones(10), 1, 0, 1.0, 4, 1)
        assert fa.result(5)[1] == 1 and fb.result(5)[1] == 1
    finally:
        a.close()
        b.close()
        server.close()


def test_a_request_given_up_on_is_cancelled(loop):  # noqa: F811
    """Without a grace the server gives up after its timeout, answers an error and cancels the
    coroutine (which would otherwise still write a snapshot into a buffer nobody reads). The push
    runs on the event loop because a checkpoint hold of its step is in force (a direct sync push
    waits on its connection thread, bounded by barrier_timeout_s: tests/dataplane/test_direct_sync.py)."""
    shard = make_shard(mode="sync", n=10, replicas=2, replicas_to_aggregate=2, barrier_timeout_s=30)
    server = ShardServer(shard, loop, SECRET, timeout=1)
    a = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=10, shared_memory=False)

    async def tasks():
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        assert on_loop(loop, shard.hold()) == 0
        with pytest.raises(DataPlaneError, match="no result from the ps in 1 s"):
            a.push_sync(torch.ones(10), 0, 0, 1.0, 4, 1).result(5)
        time.sleep(0.1)
        assert on_loop(loop, tasks()) == []
    finally:
        a.close()
        server.close()


# ------------------------------------------------------------------ M16: fencing


def test_a_replaced_attempt_cannot_push(loop, shm):  # noqa: F811
    """The session resubmitted replica 0 (attempt 2) after its worker hung; the old attempt 1
    thaws and pushes under the same index: refused, nothing applied; attempt 2 trains."""
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, SECRET)
    old = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=shm, attempt=1)
    new = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=shm, attempt=2)
    try:
        on_loop(loop, shard.set_owner(0, 2))
        with pytest.raises(DataPlaneError, match="attempt 1 is fenced off: attempt 2 owns"):
            old.push_pull(torch.ones(10), 0, 0, 0.1, 4, 1).result(5)
        assert shard.step == 0 and torch.equal(shard.param, torch.ones(10)) and shard.core.records.samples_total == 0
        assert new.push_pull(torch.ones(10), 0, 0, 0.1, 4, 1).result(5)[1] == 1
    finally:
        old.close()
        new.close()
        server.close()


# ------------------------------------------------------------------ L2: /dev/shm hygiene


@pytest.mark.skipif(not os.path.isdir(shm_mod.SHM_DIR), reason="no /dev/shm on this machine")
def test_a_killed_replicas_file_is_swept():
    """A replica SIGKILLed after creating its file (before the handshake unlinks it) leaves a
    file; the sweeper removes it once old enough, and leaves a live process's file alone."""
    code = ("import sys, time, torch; from dtrain.dataplane.shm import SharedSlots; "
            "o = SharedSlots.create(1000, torch.float32); print(o[1], flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    path = os.path.join(shm_mod.SHM_DIR, name)
    mine = shm_mod.SharedSlots.create(10, torch.float32)
    assert mine is not None
    mine_path = os.path.join(shm_mod.SHM_DIR, mine[1])
    try:
        assert os.path.exists(path) and name.startswith(f"dtrain-{proc.pid:08x}")
        assert shm_mod.sweep_stale() == []  # too recent: a creator may still be handshaking
        old = time.time() - 2 * shm_mod.STALE_S
        os.utime(path, (old, old))
        os.utime(mine_path, (old, old))
        assert shm_mod.sweep_stale() == [name]
        assert not os.path.exists(path) and os.path.exists(mine_path)  # this process lives
    finally:
        mine[0].close()
        shm_mod.unlink(mine_path)
        shm_mod.unlink(path)


@pytest.mark.skipif(not os.path.isdir(shm_mod.SHM_DIR), reason="no /dev/shm on this machine")
def test_shm_offer_leaves_headroom(loop, monkeypatch):  # noqa: F811
    """With /dev/shm 95 % full the replica offers no file: the connection uses the socket."""
    real = os.statvfs(shm_mod.SHM_DIR)
    fake = os.statvfs_result((real.f_bsize, 4096, 1000, 50, 50, 0, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    shard = make_shard(n=10)
    server = ShardServer(shard, loop, SECRET)
    client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5)
    try:
        assert client.shm is None and server.shared_connections == 0
        assert client.push_pull(torch.ones(10), 0, 0, 0.1, 4, 1).result(5)[1] == 1
    finally:
        client.close()
        server.close()


# ------------------------------------------------------------------ M6: where the listener binds


def test_data_plane_over_ipv6(loop):  # noqa: F811
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = ShardServer(make_shard(n=10), loop, SECRET, host="::1")
    client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
    try:
        assert server.host == "::1" and client.push_pull(torch.ones(10), 0, 0, 0.1, 4, 1).result(5)[1] == 1
    finally:
        client.close()
        server.close()


def test_a_non_local_contact_host_listens_on_the_wildcard(loop):  # noqa: F811
    """Behind NAT the worker's contact host (here TEST-NET-3, no local interface) cannot be
    bound (EADDRNOTAVAIL failed the run): the server listens on the wildcard and still hands
    out the contact host, which replicas reach through the NAT (here: through 127.0.0.1)."""
    server = ShardServer(make_shard(n=10), loop, SECRET, host="203.0.113.7")
    try:
        assert server.host == "203.0.113.7" and server._sock.getsockname()[0] == "0.0.0.0"
        client = SocketShard("127.0.0.1", server.port, SECRET, replica=0, numel=10, timeout=5, shared_memory=False)
        assert client.pull(0).result(5)[1] == 0
        client.close()
    finally:
        server.close()


# ------------------------------------------------------------------ TLS: the same limits


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "make_certs.py"), str(d), "--host",
                          "127.0.0.1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {"ca": (d / "ca.pem").read_text(), "cert": (d / "cluster.pem").read_text(),
            "key": (d / "cluster-key.pem").read_text()}


def test_tls_handshake_deadline_and_idle_connection(loop, tls):  # noqa: F811
    """With TLS the deadline also covers the TLS handshake (a drip of ClientHello bytes is cut),
    and an idle authenticated TLS connection is kept."""
    server = ShardServer(make_shard(n=10), loop, SECRET, ssl_context=proto.server_ssl_context(tls), timeout=0.5,
                         handshake_timeout=1)
    client = SocketShard(server.host, server.port, SECRET, replica=0, numel=10, timeout=5,
                         ssl_context=proto.client_ssl_context(tls), shared_memory=False)
    drip = socket.create_connection((server.host, server.port), timeout=5)
    try:
        drip.sendall(b"\x16\x03\x01\x02\x00")  # a TLS record header announcing 512 bytes, then a trickle
        assert drip_until_closed(drip) < 5  # (never cut: inf)
        assert client.pull(0).result(5)[1] == 0  # idle 1 s past the 0.5 s server timeout
    finally:
        drip.close()
        client.close()
        server.close()
