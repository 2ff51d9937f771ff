"""The ps side of the data plane: ``ShardServer`` serves one ParameterShard to its replicas,
one thread per authenticated connection, running every request on the ps's event loop through
the shard's own methods (so sync barriers, staleness and checkpoint holds are identical to the
actor path). See ``protocol`` for the bytes."""

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
from typing import Any

import numpy as np
import torch

from . import protocol as proto
from .shm import F_SHM, SharedSlots

logger = logging.getLogger(__name__)


class ShardServer:
    """Serves one ParameterShard to replicas over TCP (started inside the ps actor)."""

    def __init__(self, shard: Any, loop: asyncio.AbstractEventLoop, secret: bytes, host: str = "127.0.0.1",
                 ssl_context: ssl.SSLContext | None = None, timeout: float = 120.0, wire_dtype: str = "float32"):
        self.shard = shard
        self.wire = proto.WIRE_DTYPES[wire_dtype]
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
        conn.sendall(proto.MAGIC + nonce)
        answer = proto.recv_bytes(conn, 32 + 4)
        (name_len,) = struct.unpack("<H", proto.recv_bytes(conn, 2))
        offer = (proto.recv_bytes(conn, name_len).decode(errors="replace"), proto.recv_bytes(conn, 16)) if name_len else None
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
            proto.tune(conn, self.timeout)
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
            gview = proto.tensor_view(wire_in) if wire_in is not None else None
            header = bytearray(proto.REQ.size)
            while not self._closed.is_set():
                try:
                    proto.recv_exact(conn, memoryview(header))
                except (proto.DataPlaneError, OSError):
                    return
                op, flags, _pad, replica, version, local_step, loss, samples, offset, nbytes = proto.REQ.unpack(header)
                if flags & F_SHM:
                    if shm is None:
                        raise proto.DataPlaneError("a shared-memory request on a connection without shared memory")
                    src, out = shm.grad[(flags >> 1) & 1], shm.param[(flags >> 2) & 1]
                    if f32:
                        g, target = src, out  # the apply reads the slot, the snapshot lands in one
                    else:
                        g, target = grad.copy_(src) if op != proto.OP_PULL else grad, reply
                    self._answer(conn, op, g, replica, version, local_step, loss, samples, target,
                                 narrow_into=None if f32 else out, send=False)
                    continue
                if nbytes:
                    if offset + nbytes > len(gview) or offset % gview.itemsize:
                        raise proto.DataPlaneError(f"gradient bytes [{offset}, {offset + nbytes}) outside a shard of "
                                             f"{len(gview)} bytes")
                    proto.recv_exact(conn, gview[offset:offset + nbytes])
                if op == proto.OP_PART:
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
        if op == proto.OP_PULL:
            coro = self.shard.pull(version, out=out)
        else:
            coro = getattr(self.shard, proto.OPS[op])(grad, replica, version, loss_value, samples, local_step, out=out)
        try:
            params, step, stop, generation = asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".encode()
            conn.sendall(proto.REP.pack(0, 1, 1, 0, 0, len(msg)) + msg)
            return
        if narrow_into is not None:
            narrow_into.copy_(params)
            params = narrow_into
        if not send:
            conn.sendall(proto.REP.pack(step, int(stop), 0, 0, generation, 0))
            return
        payload = proto.tensor_view(params)
        conn.sendall(proto.REP.pack(step, int(stop), 0, 0, generation, len(payload)))
        conn.sendall(payload)

    def close(self) -> None:
        self._closed.set()
        for s in [self._sock, *self._conns]:
            try:  # shutdown wakes a thread blocked in accept() or recv(): close() alone does not (Linux)
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
