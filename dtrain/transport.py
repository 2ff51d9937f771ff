"""The socket data plane: flat parameter and gradient buffers over one persistent TCP connection
per replica and shard, with Dask kept as the control plane (``training.transport: socket``).

Why: with actor calls as the data plane every step pays Dask's framing, per-message buffer
allocation and thread hand-offs on the replica's own core (../shared/ps-data-plane.md measured
0.75x plain PyTorch with 1 replica that way, 0.93x with a raw socket). Here the ps actor opens a
listener and hands out its port; a replica connects once, then every step is one
``sendall`` of the gradient and one ``recv_into`` of the parameters, into preallocated buffers,
from a background thread (the syscalls release the GIL, so they overlap the next step's compute).

Protocol (little-endian):

- handshake: server sends ``MAGIC`` + a 16-byte nonce; the client answers
  ``HMAC-SHA256(secret, nonce)`` (32 bytes) + its replica index (u32). A wrong answer closes the
  connection: only processes that got the per-run secret through Dask can push gradients.
- request: header ``<B op, B flags, H pad, I replica, q version, q local_step, d loss, I samples,
  Q nbytes>`` then ``nbytes`` of float32 gradient (op push_pull / push_sync / pull).
- reply: header ``<q step, B stop, B error, H pad, I generation, Q nbytes>`` then the parameters;
  ``error`` replies carry a UTF-8 message instead.

The server runs each request on the worker's event loop (``run_coroutine_threadsafe``) through
the same ``ParameterShard`` methods as the actor path, so sync barriers, staleness and snapshots
behave identically; only the bytes travel differently. No Dask import here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"DTRN1"
REQ = struct.Struct("<BBHIqqdIQ")
REP = struct.Struct("<qBBHIQ")
OP_PUSH_PULL, OP_PUSH_SYNC, OP_PULL = 1, 2, 3
_OPS = {OP_PUSH_PULL: "push_pull", OP_PUSH_SYNC: "push_sync"}


class DataPlaneError(RuntimeError):
    """The data-plane connection failed (closed, timed out, refused the handshake)."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    # MSG_WAITALL: the kernel fills the whole buffer in one call (one GIL release and re-acquire
    # per message instead of one per 64 KB chunk, which the compute thread would feel).
    flags = socket.MSG_WAITALL if not isinstance(sock, ssl.SSLSocket) else 0
    while len(view):
        n = sock.recv_into(view, len(view), flags)
        if n == 0:
            raise DataPlaneError("connection closed by the peer")
        view = view[n:]


def _tune(sock: socket.socket, timeout: float) -> None:
    """Blocking socket with kernel-level timeouts (SO_RCVTIMEO/SO_SNDTIMEO): Python's own timeout
    makes the fd non-blocking, which defeats MSG_WAITALL."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        except OSError:  # capped by the kernel: fine
            pass


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _tensor_view(t: torch.Tensor) -> memoryview:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same bytes as int16
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------------- server


class ShardServer:
    """Serves one ParameterShard to replicas over TCP (started inside the ps actor)."""

    def __init__(self, shard: Any, loop: asyncio.AbstractEventLoop, secret: bytes, host: str = "127.0.0.1",
                 ssl_context: ssl.SSLContext | None = None, timeout: float = 120.0, wire_dtype: str = "float32"):
        self.shard = shard
        self.wire = WIRE_DTYPES[wire_dtype]
        self.loop = loop
        self.secret = secret
        self.timeout = timeout
        self.ssl_context = ssl_context
        self._sock = socket.create_server((host, 0), backlog=64)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name=f"dtrain-ps{shard.index}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"dtrain-ps{self.shard.index}-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _tune(conn, self.timeout)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            self._conns.append(conn)
            nonce = os.urandom(16)
            conn.sendall(MAGIC + nonce)
            answer = _recv_bytes(conn, 32 + 4)
            expected = hmac.new(self.secret, nonce, hashlib.sha256).digest()
            if not hmac.compare_digest(answer[:32], expected):
                logger.warning("ps %d: data-plane handshake refused (bad secret)", self.shard.index)
                return
            grad = torch.empty(self.shard.param.numel(), dtype=torch.float32)
            # Lower-precision wire: receive into a wire-dtype buffer and widen into ``grad``;
            # replies are narrowed into a per-connection send buffer.
            wire_in = grad if self.wire == torch.float32 else torch.empty_like(grad, dtype=self.wire)
            self._wire_out = None if self.wire == torch.float32 else torch.empty_like(grad, dtype=self.wire)
            gview = _tensor_view(wire_in)
            header = bytearray(REQ.size)
            while not self._closed.is_set():
                try:
                    _recv_exact(conn, memoryview(header))
                except (DataPlaneError, OSError):
                    return
                op, _flags, _pad, replica, version, local_step, loss, samples, nbytes = REQ.unpack(header)
                if nbytes:
                    if nbytes != len(gview):
                        raise DataPlaneError(f"gradient of {nbytes} bytes for a shard of {len(gview)}")
                    _recv_exact(conn, gview)
                    if wire_in is not grad:
                        grad.copy_(wire_in)
                self._answer(conn, op, grad, replica, version, local_step, loss, samples, self._wire_out)
        except Exception as exc:  # one replica's broken connection must not take the ps down
            if not self._closed.is_set():
                logger.info("ps %d: data-plane connection ended: %s", self.shard.index, exc)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, conn: socket.socket, op: int, grad: torch.Tensor, replica: int, version: int,
                local_step: int, loss: float, samples: int, wire_out: torch.Tensor | None = None) -> None:
        loss_value = None if np.isnan(loss) and samples == 0 else loss
        if op == OP_PULL:
            coro = self.shard.pull(version)
        else:
            coro = getattr(self.shard, _OPS[op])(grad, replica, version, loss_value, samples, local_step)
        try:
            params, step, stop, generation = asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".encode()
            conn.sendall(REP.pack(0, 1, 1, 0, 0, len(msg)) + msg)
            return
        if wire_out is not None:
            wire_out.copy_(params)
            params = wire_out
        payload = _tensor_view(params)
        conn.sendall(REP.pack(step, int(stop), 0, 0, generation, len(payload)))
        conn.sendall(payload)

    def close(self) -> None:
        self._closed.set()
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass


# ----------------------------------------------------------------------------------- client


class SocketShard:
    """A replica's handle on one shard over the socket data plane. Its methods mirror the actor's
    (``push_pull``, ``push_sync``, ``pull``) and return futures with ``.result(timeout=)``; one
    request is in flight at a time, run by a background thread so it overlaps compute."""

    def __init__(self, host: str, port: int, secret: bytes, replica: int, numel: int, timeout: float = 60.0,
                 ssl_context: ssl.SSLContext | None = None, wire_dtype: str = "float32"):
        self.replica = replica
        self.wire = WIRE_DTYPES[wire_dtype]
        self._wire_out = None if self.wire == torch.float32 else torch.empty(numel, dtype=self.wire)
        self._wire_in = None if self.wire == torch.float32 else torch.empty(numel, dtype=self.wire)
        self.timeout = timeout
        self._sock = socket.create_connection((host, port), timeout=timeout)
        _tune(self._sock, timeout)
        if ssl_context is not None:
            self._sock = ssl_context.wrap_socket(self._sock, server_hostname=host)
        try:
            magic = _recv_bytes(self._sock, len(MAGIC))
        except DataPlaneError:
            magic = b""
        if magic != MAGIC:
            raise DataPlaneError(f"{host}:{port} is not a dtrain ps data plane")
        digest = hmac.new(secret, _recv_bytes(self._sock, 16), hashlib.sha256).digest()
        self._sock.sendall(digest + struct.pack("<I", replica))
        # Two persistent receive buffers: the replica copies one into its model while the next
        # reply may already be arriving in the other.
        self._bufs = [torch.empty(numel, dtype=torch.float32) for _ in range(2)]
        self._next = 0
        self._header = bytearray(REP.size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"dtrain-dp-r{replica}")

    def _roundtrip(self, op: int, grad: torch.Tensor | None, version: int, loss: float | None, samples: int,
                   local_step: int) -> tuple[torch.Tensor, int, bool, int]:
        try:
            if grad is not None and self._wire_out is not None:
                self._wire_out.copy_(grad)  # narrowed here, on this thread, off the compute path
                grad = self._wire_out
            payload = _tensor_view(grad) if grad is not None else None
            header = REQ.pack(op, 0, 0, self.replica, version, local_step,
                              float("nan") if loss is None else loss, samples, len(payload) if payload else 0)
            self._sock.sendall(header)
            if payload is not None:
                self._sock.sendall(payload)
            _recv_exact(self._sock, memoryview(self._header))
            step, stop, error, _pad, generation, nbytes = REP.unpack(self._header)
            if error:
                raise DataPlaneError(_recv_bytes(self._sock, nbytes).decode(errors="replace"))
            buf = self._bufs[self._next]
            self._next ^= 1
            target = buf if self._wire_in is None else self._wire_in
            view = _tensor_view(target)
            if nbytes != len(view):
                raise DataPlaneError(f"parameters of {nbytes} bytes, expected {len(view)}")
            _recv_exact(self._sock, view)
            if target is not buf:
                buf.copy_(target)
            return buf, step, bool(stop), generation
        except TimeoutError:
            raise DataPlaneError(f"no answer from the ps in {self.timeout:.0f} s") from None
        except OSError as exc:
            raise DataPlaneError(f"data-plane connection failed: {exc}") from None

    def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0) -> Future:
        return self._pool.submit(self._roundtrip, OP_PUSH_PULL, grad, version, loss, samples, local_step)

    def push_sync(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0) -> Future:
        return self._pool.submit(self._roundtrip, OP_PUSH_SYNC, grad, version, loss, samples, local_step)

    def pull(self, min_step: int = 0) -> Future:
        return self._pool.submit(self._roundtrip, OP_PULL, None, min_step, None, 0, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._sock.close()
        except OSError:
            pass


def _load_chain(ctx: ssl.SSLContext, cert_pem: str, key_pem: str | None) -> None:
    """load_cert_chain needs files: write the PEMs to a private temporary directory."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dtrain-tls-") as d:
        os.chmod(d, 0o700)
        cert = os.path.join(d, "cert.pem")
        with open(cert, "w") as f:
            f.write(cert_pem)
        key = None
        if key_pem:
            key = os.path.join(d, "key.pem")
            with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(key_pem)
        ctx.load_cert_chain(cert, key)


def client_ssl_context(tls: dict[str, str | None]) -> ssl.SSLContext:
    """TLS for a replica's connection, from PEM texts (``ca``, ``cert``, ``key``) sent through
    Dask: the files named in ``cluster.security`` live on the client's machine, not the workers'."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=tls["ca"])
    ctx.check_hostname = False  # workers are addressed by IP; the CA and the HMAC secret authenticate
    if tls.get("cert"):
        _load_chain(ctx, tls["cert"], tls.get("key"))
    return ctx


def server_ssl_context(tls: dict[str, str | None]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=tls["ca"])
    _load_chain(ctx, tls["cert"], tls.get("key"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
