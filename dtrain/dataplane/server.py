"""The ps side of the data plane: ``ShardServer`` serves one ParameterShard to its replicas,
one thread per authenticated connection, running every request on the ps's event loop through
the shard's own methods (so sync barriers, staleness and checkpoint holds are identical to the
actor path), except a plain async or sync push: the connection thread runs it itself, under
the shard's lock, when nothing but the sync barrier can make it wait (``push_direct``,
ps/fastpath.py; ``push_sync_direct``, ps/sync_push.py).
See ``protocol`` for the bytes.

Abuse and faults (anyone who can reach the port can connect): a handshake has an absolute
deadline (a 1-byte drip cannot keep it alive) and at most ``MAX_PENDING`` connections may be in
their handshake at once (a new one closes the oldest: silent sockets cannot keep a replica out,
only a flood faster than a replica's handshake could); refused handshakes are logged rate-limited;
a transient ``accept()`` error (EMFILE...) never stops the listener. An authenticated
connection has no idle timeout (a replica may load its data or run a long step between
requests; TCP keepalive and the session's liveness checks find dead peers), every header field
is checked with integer tests and a bad one is answered with an error reply, then the
connection closed, and the server logs at WARNING every connection it ends itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import hmac
import logging
import math
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any

import torch

from . import protocol as proto
from .protocol import ANSWERED
from .rows import F_SPARSE, SparseBlock, encode_rows, read_request
from .shm import F_SHM, SharedParams, SharedSlots

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # connections in their handshake at once; a new one past it closes the oldest
_VALID_OPS = (proto.OP_PUSH_PULL, proto.OP_PUSH_SYNC, proto.OP_PULL, proto.OP_PART)


class _Refused(Exception):
    """A request the server answers with an error reply, then closes the connection."""


class ShardServer:
    """Serves one ParameterShard to replicas over TCP (started inside the ps actor).

    ``timeout``: the per-request wait on the ps (extended while the shard grants a barrier
    grace) and the socket send timeout; ``handshake_timeout``: the absolute deadline of a
    connection's handshake (default ``min(timeout, 10)``); ``share_params``: offer the replicas on
    this machine the shard's parameters to read in place where the shard allows it
    (``shares_params``: sync without backup replicas; dataplane/shm.py, ``SharedParams``)."""

    def __init__(self, shard: Any, loop: asyncio.AbstractEventLoop, secret: bytes, host: str = "127.0.0.1",
                 ssl_context: ssl.SSLContext | None = None, timeout: float = 120.0, wire_dtype: str = "float32",
                 handshake_timeout: float | None = None, share_params: bool = False):
        self.shard = shard
        self.wire = proto.WIRE_DTYPES[wire_dtype]
        self.loop = loop
        self.secret = secret
        self.timeout = timeout
        self.handshake_timeout = min(timeout, 10.0) if handshake_timeout is None else handshake_timeout
        self.ssl_context = ssl_context
        self._sock = proto.listen(host, f"ps {shard.index}: the data plane")
        self._sock.settimeout(0.25)  # the accept loop also cuts handshakes past their deadline
        self.host, self.port = host, self._sock.getsockname()[1]  # replicas connect to ``host``
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # open connections (closed ones leave in _serve)
        self._pending: dict[socket.socket, float] = {}  # in their handshake: deadline (monotonic)
        self._refusals = 0  # refused handshakes not yet logged (rate-limited)
        self._refusal_logged = 0.0
        self.connections = 0  # replica connections that passed the handshake
        self.shared_connections = 0  # ... of which use shared memory
        self.in_place_connections = 0  # ... of which read the parameters in place
        # The shard's parameters in a memfd that replicas on this machine map read-only.
        self.params: SharedParams | None = None
        if share_params and self.wire == torch.float32 and shard.shares_params:
            self.params = SharedParams.create(shard.param.numel())
            if self.params is not None:
                shard.adopt_params(self.params.tensor)
        self._thread = threading.Thread(target=self._accept, name=f"dtrain-ps{shard.index}-accept", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ accepting
    def _accept(self) -> None:
        failures = 0  # consecutive accept() errors (logged on the first, then every 100th)
        while not self._closed.is_set():
            self._cut_overdue()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # EMFILE, ENOBUFS, ECONNABORTED...: transient, keep listening
                if self._closed.is_set():
                    return
                if failures % 100 == 0:
                    logger.warning("ps %d: data-plane accept failed %d time(s) in a row (%s); still listening",
                                   self.shard.index, failures + 1, exc)
                failures += 1
                time.sleep(0.1)
                continue
            failures = 0
            with self._lock:
                # At the cap the oldest handshake gives way: refusing the newest instead let
                # MAX_PENDING silent sockets, renewed at each deadline, lock every replica out.
                oldest = min(self._pending, key=self._pending.__getitem__) \
                    if len(self._pending) >= MAX_PENDING else None
                if oldest is not None:
                    del self._pending[oldest]
                self._pending[conn] = time.monotonic() + self.handshake_timeout
                self._conns.add(conn)
            if oldest is not None:
                self._note_refusal("too many connections in their handshake: the oldest was closed")
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # (its thread then ends, and closes it)
                except OSError:
                    pass
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"dtrain-ps{self.shard.index}-conn").start()
            except RuntimeError as exc:  # can't start new thread
                logger.warning("ps %d: data-plane connection dropped: %s", self.shard.index, exc)
                self._forget(conn)
                _close(conn)

    def _cut_overdue(self) -> None:
        """Shut down connections whose handshake ran past its deadline (their thread then ends)."""
        now = time.monotonic()
        with self._lock:
            overdue = [c for c, deadline in self._pending.items() if deadline < now]
            for c in overdue:
                del self._pending[c]
        for c in overdue:
            self._note_refusal("handshake deadline passed")
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._conns.discard(conn)

    def _note_refusal(self, why: str) -> None:
        """Refused handshakes: one WARNING at most every 10 s, with how many were refused."""
        self._refusals += 1
        now = time.monotonic()
        if now - self._refusal_logged >= 10.0:
            logger.warning("ps %d: %d data-plane connection(s) refused (last: %s)", self.shard.index,
                           self._refusals, why)
            self._refusals, self._refusal_logged = 0, now

    def _handshake(self, conn: socket.socket, numel: int) -> tuple[int, SharedSlots | None, bool] | None:
        """HMAC challenge, the replica's attempt id and shared-memory offer (a file name and a
        token); the answer is one byte: 0 refused (wrong secret), 1 accepted, 2 accepted with
        shared memory, 3 that and the parameters to read in place (the ps's pid, the memfd's
        number and its token follow; the replica answers one byte, 1 if it mapped them).
        Returns (attempt, slots, in place), or None when refused."""
        nonce = os.urandom(16)
        conn.sendall(proto.MAGIC + nonce)
        answer = proto.recv_bytes(conn, 32 + 4 + 4)
        (name_len,) = struct.unpack("<H", proto.recv_bytes(conn, 2))
        offer = (proto.recv_bytes(conn, name_len).decode(errors="replace"), proto.recv_bytes(conn, 16)) if name_len else None
        expected = hmac.new(self.secret, nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(answer[:32], expected):
            self._note_refusal("bad secret")
            conn.sendall(b"\x00")
            return None
        _replica, attempt = struct.unpack("<II", answer[32:])
        shm = SharedSlots.attach(offer[0], offer[1], numel, self.wire) if offer else None
        # Counted before the answer: once the replica reads it, the counts include it.
        self.connections += 1
        self.shared_connections += shm is not None
        in_place = False
        if shm is not None and self.params is not None and self.params.fd >= 0:
            conn.sendall(b"\x03" + struct.pack("<II", os.getpid(), self.params.fd) + self.params.token)
            in_place = proto.recv_bytes(conn, 1) == b"\x01"
            self.in_place_connections += in_place
        else:
            conn.sendall(b"\x02" if shm is not None else b"\x01")
        if shm is not None and isinstance(conn, ssl.SSLSocket):
            conn.unwrap()  # only headers cross this socket, on this machine: see protocol.py (TLS)
        return attempt, shm, in_place

    # ------------------------------------------------------------------ serving
    def _serve(self, conn: socket.socket) -> None:
        shm: SharedSlots | None = None
        raw = conn
        authenticated = False
        try:
            proto.tune(conn, self.timeout)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                with self._lock:  # track the TLS socket (the raw one is detached now)
                    if raw not in self._pending:
                        return
                    self._pending[conn] = self._pending.pop(raw)
                    self._conns.discard(raw)
                    self._conns.add(conn)
                conn.do_handshake()
            numel = self.shard.param.numel()
            accepted = self._handshake(conn, numel)
            with self._lock:
                in_time = self._pending.pop(conn, None) is not None
            if accepted is None or not in_time:
                return
            attempt, shm, in_place = accepted
            authenticated = True
            # Authenticated: no idle timeout (the replica may load data, build its model or run a
            # long step before its next request); keepalive finds a dead peer.
            proto.authenticated(conn)
            self._requests(conn, numel, shm, attempt, in_place)
        except Exception as exc:  # one replica's broken connection must not take the ps down
            if self._closed.is_set():
                pass
            elif authenticated:
                logger.warning("ps %d: data-plane connection ended: %s", self.shard.index, exc)
            else:  # anyone can reach the port: no log line per failed handshake
                self._note_refusal(f"handshake failed: {exc}")
        finally:
            self._forget(raw)
            self._forget(conn)
            if shm is not None:
                shm.close()
            _close(conn)

    def _requests(self, conn: socket.socket, numel: int, shm: SharedSlots | None, attempt: int,
                  in_place: bool = False) -> None:
        """The request loop of one authenticated connection. Every header field is checked with
        integer tests (no allocation); a bad one is answered with an error reply and ends it.
        ``in_place``: the replica reads the shard's parameters where they lie (no snapshot)."""
        f32 = self.wire == torch.float32
        # Per-connection buffers: the received gradient (float32) and the reply's snapshot,
        # each only where the wire or the shared slots cannot serve directly.
        grad = torch.empty(numel, dtype=torch.float32) if shm is None or not f32 else None
        wire_in = None if shm is not None else (grad if f32 else torch.empty(numel, dtype=self.wire))
        reply = torch.empty(numel, dtype=torch.float32) if shm is None or not f32 else None
        wire_out = None if f32 or shm is not None else torch.empty(numel, dtype=self.wire)
        gview = proto.tensor_view(wire_in) if wire_in is not None else None
        gbytes = len(gview) if gview is not None else 0
        itemsize = torch.empty((), dtype=self.wire).element_size()
        num_replicas = self.shard.num_replicas
        # Pushes this thread may run itself (ps/fastpath.py, ps/sync_push.py): op -> the shard's method.
        direct = {op: getattr(self.shard, name) for op, name, ok in (
            (proto.OP_PUSH_PULL, "push_direct", "direct_pushes"), (proto.OP_PUSH_SYNC, "push_sync_direct", "direct_sync"))
            if getattr(self.shard, ok, False)}
        dims = {name: part.dim for name, part in getattr(self.shard, "tables", {}).items()}
        header = bytearray(proto.REQ.size)
        hview = memoryview(header)
        while not self._closed.is_set():
            try:
                proto.recv_exact(conn, hview)
            except proto.DataPlaneError:
                return  # the replica closed its end between requests: its normal end
            op, flags, _pad, replica, version, local_step, loss, samples, offset, nbytes = proto.REQ.unpack(header)
            try:
                if op not in _VALID_OPS:
                    raise _Refused(f"unknown op {op} (a newer or broken client)")
                if replica >= num_replicas:
                    raise _Refused(f"replica {replica} of a run with {num_replicas} replicas")
                if op != proto.OP_PULL and op != proto.OP_PART:
                    owner = self.shard.owners.get(replica)
                    if owner is not None and owner != attempt:
                        raise _Refused(f"replica {replica}'s attempt {attempt} is fenced off: attempt {owner} "
                                       "owns that replica now (a replaced replica came back)")
                sparse = None
                if flags & F_SPARSE and op == proto.OP_PART:
                    raise _Refused("a sparse block on a part")
                if flags & F_SHM:
                    if shm is None or op == proto.OP_PART or nbytes:
                        raise _Refused(f"a shared-memory request (op {op}, {nbytes} bytes) on a connection "
                                       f"{'without' if shm is None else 'with'} shared memory")
                    sparse = self._sparse(conn, flags, dims)
                    src = shm.grad[(flags >> 1) & 1]
                    out = self.shard.param if in_place else shm.param[(flags >> 2) & 1]
                    if f32:
                        g, target = src, out  # the apply reads the slot, the snapshot lands in one
                    else:
                        assert grad is not None and reply is not None  # (allocated for a bfloat16 wire)
                        g, target = grad.copy_(src) if op != proto.OP_PULL else grad, reply
                    self._answer(conn, op, g, replica, version, local_step, loss, samples, target,
                                 narrow_into=None if f32 else out, send=False, sparse=sparse, dims=dims,
                                 direct=direct)
                    continue
                if nbytes:
                    if offset + nbytes > gbytes or offset % itemsize or nbytes % itemsize:
                        raise _Refused(f"gradient bytes [{offset}, {offset + nbytes}) not whole {itemsize}-byte "
                                       f"values inside a shard of {gbytes} bytes")
                    assert gview is not None  # (a connection without shared memory)
                    proto.recv_exact(conn, gview[offset:offset + nbytes])
                sparse = self._sparse(conn, flags, dims)
            except _Refused as exc:
                logger.warning("ps %d: data-plane request refused, connection closed: %s", self.shard.index, exc)
                self._error(conn, str(exc))
                return
            if op == proto.OP_PART:
                continue  # a bucket: the push that completes the gradient follows
            assert grad is not None and reply is not None  # (a connection without shared memory)
            if wire_in is not grad:
                assert wire_in is not None
                grad.copy_(wire_in)
            self._answer(conn, op, grad, replica, version, local_step, loss, samples, reply,
                         narrow_into=wire_out, send=True, sparse=sparse, dims=dims, direct=direct)

    def _sparse(self, conn: socket.socket, flags: int, dims: dict[str, int]) -> SparseBlock | None:
        """The request's sparse block (flag ``F_SPARSE``), checked against this shard's tables."""
        if not flags & F_SPARSE:
            return None
        try:
            return read_request(conn, dims, self.wire)
        except ValueError as exc:
            raise _Refused(str(exc)) from None

    def _error(self, conn: socket.socket, message: str) -> None:
        msg = message.encode()[:proto.MAX_ERROR]
        conn.sendall(proto.REP.pack(0, 1, 1, 0, 0, len(msg)) + msg)

    def _answer(self, conn: socket.socket, op: int, grad: torch.Tensor, replica: int, version: int,
                local_step: int, loss: float, samples: int, out: torch.Tensor,
                narrow_into: torch.Tensor | None, send: bool, sparse: SparseBlock | None = None,
                dims: dict[str, int] | None = None, direct: dict | None = None) -> None:
        """Run the request — a push on this thread when ``direct`` has its op and the shard allows
        it now (``push_direct``, ``push_sync_direct``), else on the ps's event loop (the actor's own
        methods) —, snapshot into ``out``, and answer (:meth:`_reply`). A direct sync push that
        waits for its step is answered by the push that completes the step (``ANSWERED``): its
        replica's reply then leaves with the step, not after this thread has woken."""
        loss_value = None if math.isnan(loss) and samples == 0 else loss
        respond = functools.partial(self._reply, conn, sparse, dims or {}, narrow_into, send)
        try:
            reply = None
            if direct and op in direct:
                reply = direct[op](self.loop, grad, replica, version, loss_value, samples, local_step, out, sparse,
                                   respond=respond)
                if reply is ANSWERED:  # the push that completed the step sent this one's reply
                    return
            if reply is None:
                reply = self._on_loop(op, grad, replica, version, loss_value, samples, local_step, out, sparse)
        except Exception as exc:
            self._error(conn, f"{type(exc).__name__}: {exc}")
            return
        respond(reply)

    def _reply(self, conn: socket.socket, sparse: SparseBlock | None, dims: dict[str, int], narrow_into: torch.Tensor | None,
               send: bool, reply: tuple) -> None:
        """Send a request's reply (the shard method's result): its header, the parameters when
        ``send`` (with shared memory they are already in the reply slot; narrowed into
        ``narrow_into`` for a bfloat16 wire), then the rows block of a request with ``sparse``."""
        params, step, stop, generation, *rest = reply
        tail = encode_rows(sparse, rest[0], dims, self.wire) if sparse is not None else []
        if narrow_into is not None:
            narrow_into.copy_(params)
            params = narrow_into
        if not send:  # the header and the rows in one call
            conn.sendall(b"".join([proto.REP.pack(step, int(stop), 0, 0, generation, 0), *tail]))
        else:
            payload = proto.tensor_view(params)
            conn.sendall(proto.REP.pack(step, int(stop), 0, 0, generation, len(payload)))
            conn.sendall(payload)
            if tail:
                conn.sendall(b"".join(tail))

    def _on_loop(self, op: int, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                 local_step: int, out: torch.Tensor, sparse: SparseBlock | None) -> tuple:
        """The request run on the ps's event loop; its reply (the shard method's result)."""
        extra = {} if sparse is None else {"sparse": sparse}
        if op == proto.OP_PULL:
            coro = self.shard.pull(version, out=out, **extra)
        else:
            coro = getattr(self.shard, proto.OPS[op])(grad, replica, version, loss, samples, local_step, out=out,
                                                      **extra)
        return self._result(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def _result(self, future: concurrent.futures.Future) -> Any:
        """The request's result, waiting ``timeout`` and longer while the shard grants a barrier
        grace (a lost replica is being restarted); a request given up on is cancelled (its
        coroutine would otherwise still count the gradient and write a snapshot nobody reads)."""
        while True:
            try:
                return future.result(self.timeout)
            except concurrent.futures.TimeoutError:
                remaining = self.shard.grace_until - time.monotonic()
                if remaining > 0 and not self._closed.is_set():
                    continue
                future.cancel()
                raise TimeoutError(f"no result from the ps in {self.timeout:.0f} s") from None

    def close(self) -> None:
        self._closed.set()
        if self.params is not None:
            self.params.close()  # no more replicas attach; the shard keeps its parameters there
        with self._lock:
            conns = list(self._conns)
        try:  # wakes the accept thread now: close() alone leaves a listener accepting until it returns
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        _close(self._sock)
        for s in conns:  # shutdown wakes a thread blocked in recv (close alone would not)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            _close(s)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
