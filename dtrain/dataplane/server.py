"""The socket data plane: flat parameter and gradient buffers over one persistent TCP connection
per replica and shard, with Dask kept as the control plane (``training.transport: socket``).

Why: with actor calls as the data plane every step pays Dask's framing, per-message buffer
allocation and thread hand-offs on the replica's own core (../shared/ps-data-plane.md measured
0.75x plain PyTorch with 1 replica that way, 0.93x with a raw socket). Here the ps actor opens a
listener and hands out its port; a replica connects once, then every step is one
``sendall`` of the gradient and one ``recv_into`` of the parameters, into preallocated buffers,
from a background thread (the syscalls release the GIL, so they overlap the next step's compute).

Same machine: the replica also offers a shared-memory file (/dev/shm) in the handshake; when the
ps can map it, gradients and parameters stay in its four slots and only the headers cross the
socket — no kernel copies, and backward writes the gradient straight into a slot
(``training.shared_memory``, on by default; anything else falls back to the socket's bytes).

Protocol (little-endian):

- handshake: server sends ``MAGIC`` + a 16-byte nonce; the client answers
  ``HMAC-SHA256(secret, nonce)`` (32 bytes) + its replica index (u32). A wrong answer closes the
  connection: only processes that got the per-run secret through Dask can push gradients. Then
  the client sends a u16 name length (0: no offer) + a /dev/shm file name + a 16-byte token that
  the file starts with; the server answers one byte (0: refused, 1: accepted, use the socket's
  bytes, 2: accepted and the file is mapped).
- request: header ``<B op, B flags, H pad, I replica, q version, q local_step, d loss, I samples,
  Q offset, Q nbytes>`` then ``nbytes`` of gradient in the wire dtype, to be stored at byte
  ``offset`` of the shard's gradient (op push_pull / push_sync / pull / part). ``part`` has no
  reply: it is a bucket sent while backward is still running (``training.bucket_mb``); the push
  that follows carries the rest of the gradient, usually its head, and applies the whole.
  ``flags``: bit 0 shared memory (``nbytes`` 0), bit 1 the gradient slot, bit 2 the reply slot.
- reply: header ``<q step, B stop, B error, H pad, I generation, Q nbytes>`` then the parameters
  (none with shared memory: they are in the reply slot); ``error`` replies carry a UTF-8
  message instead.

The server runs each request on the worker's event loop (``run_coroutine_threadsafe``) through
the same ``ParameterShard`` methods as the actor path, so sync barriers, staleness and snapshots
behave identically; only the bytes travel differently. No Dask import here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import ssl
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"DTRN2"
REQ = struct.Struct("<BBHIqqdIQQ")
REP = struct.Struct("<qBBHIQ")
OP_PUSH_PULL, OP_PUSH_SYNC, OP_PULL, OP_PART = 1, 2, 3, 4
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


# ----------------------------------------------------------------------------- shared memory
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^dtrain-[0-9a-f]{16,64}$")
_SHM_HEADER = 4096  # the token lives here; slots start page-aligned
F_SHM = 1  # request flag: the gradient and the reply travel through the shared slots


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


class SharedSlots:
    """Four buffers in one shared-memory file that a replica and a ps on the same machine both map:
    two gradient slots (the replica writes, the ps reads) and two parameter slots (the ps writes a
    reply's snapshot, the replica computes on it). Only the small headers then cross the socket,
    which orders every access (a request is sent after its slot is written, a reply after its
    slot is). The file is unlinked as soon as both sides have mapped it: nothing is left in
    /dev/shm even when a process is killed."""

    def __init__(self, mm: mmap.mmap, numel: int, dtype: torch.dtype):
        self._mm = mm
        itemsize = torch.empty((), dtype=dtype).element_size()
        n, stride = numel * itemsize, _align(numel * itemsize)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        slots = [base[_SHM_HEADER + i * stride:_SHM_HEADER + i * stride + n].view(dtype) for i in range(4)]
        self.grad, self.param = slots[:2], slots[2:]

    @staticmethod
    def nbytes(numel: int, dtype: torch.dtype) -> int:
        return _SHM_HEADER + 4 * _align(numel * torch.empty((), dtype=dtype).element_size())

    @classmethod
    def create(cls, numel: int, dtype: torch.dtype) -> tuple[SharedSlots, str, bytes] | None:
        """The replica's side: a new file, its blocks allocated up front (a full /dev/shm fails
        here, and the connection falls back to the socket, instead of a SIGBUS mid-training)."""
        if not os.path.isdir(SHM_DIR):
            return None
        name = f"dtrain-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.nbytes(numel, dtype)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            logger.info("shared memory unavailable (%s): the data plane uses the socket", exc)
            _unlink(path)
            return None
        finally:
            os.close(fd)
        token = secrets.token_bytes(16)
        mm[:16] = token
        return cls(mm, numel, dtype), name, token

    @classmethod
    def attach(cls, name: str, token: bytes, numel: int, dtype: torch.dtype) -> SharedSlots | None:
        """The ps's side: map the replica's file if it is one of ours, of the expected size, with
        the token the replica sent over the socket (else: None, and the socket carries the bytes)."""
        if not _SHM_NAME.match(name):
            return None
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None  # another machine, or another /dev/shm (a container): not shared
        try:
            st = os.fstat(fd)
            size = cls.nbytes(numel, dtype)
            if st.st_size != size or st.st_uid != os.getuid():
                return None
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
            _unlink(path)
        if not hmac.compare_digest(bytes(mm[:16]), token):
            mm.close()
            return None
        return cls(mm, numel, dtype)

    def close(self) -> None:
        self.grad = self.param = []
        try:
            self._mm.close()
        except BufferError:  # a model still views a slot: the mapping goes when the views do
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
        self.connections = 0  # replica connections that passed the handshake
        self.shared_connections = 0  # ... of which use shared memory
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

    def _handshake(self, conn: socket.socket, numel: int) -> tuple[bool, SharedSlots | None]:
        """HMAC challenge and the replica's shared-memory offer (a file name and a token); the
        answer is one byte: 0 refused (wrong secret), 1 accepted, 2 accepted with shared memory."""
        nonce = os.urandom(16)
        conn.sendall(MAGIC + nonce)
        answer = _recv_bytes(conn, 32 + 4)
        (name_len,) = struct.unpack("<H", _recv_bytes(conn, 2))
        offer = (_recv_bytes(conn, name_len).decode(errors="replace"), _recv_bytes(conn, 16)) if name_len else None
        expected = hmac.new(self.secret, nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(answer[:32], expected):
            logger.warning("ps %d: data-plane handshake refused (bad secret)", self.shard.index)
            conn.sendall(b"\x00")
            return False, None
        shm = SharedSlots.attach(offer[0], offer[1], numel, self.wire) if offer else None
        conn.sendall(b"\x02" if shm is not None else b"\x01")
        return True, shm

    def _serve(self, conn: socket.socket) -> None:
        shm: SharedSlots | None = None
        try:
            _tune(conn, self.timeout)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            self._conns.append(conn)
            numel = self.shard.param.numel()
            ok, shm = self._handshake(conn, numel)
            if not ok:
                return
            self.connections += 1
            if shm is not None:
                self.shared_connections += 1
            f32 = self.wire == torch.float32
            # Per-connection buffers: the received gradient (float32) and the reply's snapshot,
            # each only where the wire or the shared slots cannot serve directly.
            grad = torch.empty(numel, dtype=torch.float32) if shm is None or not f32 else None
            wire_in = None if shm is not None else (grad if f32 else torch.empty(numel, dtype=self.wire))
            reply = torch.empty(numel, dtype=torch.float32) if shm is None or not f32 else None
            wire_out = None if f32 or shm is not None else torch.empty(numel, dtype=self.wire)
            gview = _tensor_view(wire_in) if wire_in is not None else None
            header = bytearray(REQ.size)
            while not self._closed.is_set():
                try:
                    _recv_exact(conn, memoryview(header))
                except (DataPlaneError, OSError):
                    return
                op, flags, _pad, replica, version, local_step, loss, samples, offset, nbytes = REQ.unpack(header)
                if flags & F_SHM:
                    if shm is None:
                        raise DataPlaneError("a shared-memory request on a connection without shared memory")
                    src, out = shm.grad[(flags >> 1) & 1], shm.param[(flags >> 2) & 1]
                    if f32:
                        g, target = src, out  # the apply reads the slot, the snapshot lands in one
                    else:
                        g, target = grad.copy_(src) if op != OP_PULL else grad, reply
                    self._answer(conn, op, g, replica, version, local_step, loss, samples, target,
                                 narrow_into=None if f32 else out, send=False)
                    continue
                if nbytes:
                    if offset + nbytes > len(gview) or offset % gview.itemsize:
                        raise DataPlaneError(f"gradient bytes [{offset}, {offset + nbytes}) outside a shard of "
                                             f"{len(gview)} bytes")
                    _recv_exact(conn, gview[offset:offset + nbytes])
                if op == OP_PART:
                    continue  # a bucket: the push that completes the gradient follows
                if wire_in is not grad:
                    grad.copy_(wire_in)
                self._answer(conn, op, grad, replica, version, local_step, loss, samples, reply,
                             narrow_into=wire_out, send=True)
        except Exception as exc:  # one replica's broken connection must not take the ps down
            if not self._closed.is_set():
                logger.info("ps %d: data-plane connection ended: %s", self.shard.index, exc)
        finally:
            if shm is not None:
                shm.close()
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, conn: socket.socket, op: int, grad: torch.Tensor, replica: int, version: int,
                local_step: int, loss: float, samples: int, out: torch.Tensor,
                narrow_into: torch.Tensor | None, send: bool) -> None:
        """Run the request on the ps's event loop (the actor's own methods), snapshot into ``out``,
        narrow it into ``narrow_into`` for a bfloat16 wire, and answer: the header, then the
        parameters when ``send`` (with shared memory they are already in the reply slot)."""
        loss_value = None if np.isnan(loss) and samples == 0 else loss
        if op == OP_PULL:
            coro = self.shard.pull(version, out=out)
        else:
            coro = getattr(self.shard, _OPS[op])(grad, replica, version, loss_value, samples, local_step, out=out)
        try:
            params, step, stop, generation = asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".encode()
            conn.sendall(REP.pack(0, 1, 1, 0, 0, len(msg)) + msg)
            return
        if narrow_into is not None:
            narrow_into.copy_(params)
            params = narrow_into
        if not send:
            conn.sendall(REP.pack(step, int(stop), 0, 0, generation, 0))
            return
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
    request is in flight at a time, run by a background thread so it overlaps compute.

    With ``shared_memory`` (the default) the replica offers the ps a shared-memory file in the
    handshake; when the ps is on the same machine and can map it, the buffers stay in that file
    and only the headers cross the socket (no kernel copies); otherwise the socket carries them."""

    def __init__(self, host: str, port: int, secret: bytes, replica: int, numel: int, timeout: float = 60.0,
                 ssl_context: ssl.SSLContext | None = None, wire_dtype: str = "float32",
                 shared_memory: bool = True):
        self.replica = replica
        self.wire = WIRE_DTYPES[wire_dtype]
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
            raise DataPlaneError(f"{host}:{port} is not a dtrain ps data plane (or another dtrain version)")
        digest = hmac.new(secret, _recv_bytes(self._sock, 16), hashlib.sha256).digest()
        self.shm: SharedSlots | None = None
        offer = SharedSlots.create(numel, self.wire) if shared_memory else None
        name = offer[1] if offer else ""
        try:
            self._sock.sendall(digest + struct.pack("<IH", replica, len(name)) + name.encode()
                               + (offer[2] if offer else b""))
            answer = _recv_bytes(self._sock, 1)
        except (OSError, DataPlaneError) as exc:
            answer = b""
            logger.info("data-plane handshake with %s:%d failed: %s", host, port, exc)
        finally:
            if offer:
                _unlink(os.path.join(SHM_DIR, name))
        if answer not in (b"\x01", b"\x02"):
            if offer:
                offer[0].close()
            self._sock.close()
            raise DataPlaneError(f"the ps at {host}:{port} refused the data-plane handshake (a wrong per-run "
                                 "secret: is this replica from another run?)")
        if offer:
            if answer == b"\x02":
                self.shm = offer[0]
            else:
                offer[0].close()
        f32 = self.wire == torch.float32
        self._wire_out = None if f32 or self.shm is not None else torch.empty(numel, dtype=self.wire)
        self._wire_in = None if f32 or self.shm is not None else torch.empty(numel, dtype=self.wire)
        # Two persistent reply buffers (or shared slots): the replica computes on one while the
        # next reply may already be arriving in the other.
        self._bufs = [] if self.shm is not None and f32 else [torch.empty(numel, dtype=torch.float32)
                                                              for _ in range(2)]
        self._next = 0
        self._part_error: DataPlaneError | None = None
        self._header = bytearray(REP.size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"dtrain-dp-r{replica}")

    def grad_slots(self) -> list[torch.Tensor] | None:
        """The two float32 gradient slots in shared memory, for backward to write into directly
        (None without shared memory or with a bfloat16 wire)."""
        if self.shm is None or self.wire != torch.float32:
            return None
        return self.shm.grad

    def _grad_slot(self, grad: torch.Tensor) -> int:
        assert self.shm is not None
        for i, slot in enumerate(self.shm.grad):
            if grad.data_ptr() == slot.data_ptr() and grad.dtype == slot.dtype:
                return i
        self.shm.grad[0].copy_(grad)  # (narrowed for bfloat16) off the compute thread
        return 0

    def _roundtrip(self, op: int, grad: torch.Tensor | None, version: int, loss: float | None, samples: int,
                   local_step: int, head: int | None = None) -> tuple[torch.Tensor, int, bool, int]:
        try:
            if self._part_error is not None:
                raise self._part_error
            loss_f = float("nan") if loss is None else loss
            slot = self._next
            self._next ^= 1
            if self.shm is not None:
                gslot = self._grad_slot(grad) if grad is not None else 0
                self._sock.sendall(REQ.pack(op, F_SHM | gslot << 1 | slot << 2, 0, self.replica, version,
                                            local_step, loss_f, samples, 0, 0))
            else:
                end = 0 if grad is None else grad.numel() if head is None else head
                self._send(op, grad, 0, end, version, local_step, loss_f, samples)
            _recv_exact(self._sock, memoryview(self._header))
            step, stop, error, _pad, generation, nbytes = REP.unpack(self._header)
            if error:
                raise DataPlaneError(_recv_bytes(self._sock, nbytes).decode(errors="replace"))
            if self.shm is not None:
                if nbytes:
                    raise DataPlaneError(f"{nbytes} bytes of parameters on a shared-memory connection")
                if not self._bufs:
                    return self.shm.param[slot], step, bool(stop), generation
                buf = self._bufs[slot]
                buf.copy_(self.shm.param[slot])  # widened from bfloat16
                return buf, step, bool(stop), generation
            buf = self._bufs[slot]
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

    @property
    def sends_parts(self) -> bool:
        """Whether buckets are worth sending early: the bytes cross the socket (no shared memory)."""
        return self.shm is None

    def _send(self, op: int, grad: torch.Tensor | None, start: int, end: int, version: int = 0,
              local_step: int = 0, loss: float = 0.0, samples: int = 0) -> None:
        """A request header and ``grad[start:end]`` in the wire dtype (narrowed here, on this
        thread, off the compute path), to be stored at that offset of the ps's gradient."""
        payload, offset = b"", 0
        if grad is not None and end > start:
            if self._wire_out is not None:
                self._wire_out[start:end].copy_(grad[start:end])
                grad = self._wire_out
            payload, offset = _tensor_view(grad[start:end]), start * grad.element_size()
        self._sock.sendall(REQ.pack(op, 0, 0, self.replica, version, local_step, loss, samples, offset,
                                    len(payload)))
        if payload:
            self._sock.sendall(payload)

    def _send_part(self, grad: torch.Tensor, start: int, end: int) -> None:
        try:
            self._send(OP_PART, grad, start, end)
        except OSError as exc:
            self._part_error = DataPlaneError(f"data-plane connection failed: {exc}")

    def send_part(self, grad: torch.Tensor, start: int, end: int) -> None:
        """Send ``grad[start:end]`` now (a bucket whose gradients backward has finished), in order
        with the requests; the push that follows passes ``head`` and sends only ``grad[:head]``."""
        self._pool.submit(self._send_part, grad, start, end)

    def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0, head: int | None = None) -> Future:
        """``head``: only ``grad[:head]`` still has to be sent (the rest went by :meth:`send_part`)."""
        return self._pool.submit(self._roundtrip, OP_PUSH_PULL, grad, version, loss, samples, local_step, head)

    def push_sync(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0, head: int | None = None) -> Future:
        return self._pool.submit(self._roundtrip, OP_PUSH_SYNC, grad, version, loss, samples, local_step, head)

    def pull(self, min_step: int = 0) -> Future:
        return self._pool.submit(self._roundtrip, OP_PULL, None, min_step, None, 0, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._sock.close()
        except OSError:
            pass
        if self.shm is not None:
            self.shm.close()


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
