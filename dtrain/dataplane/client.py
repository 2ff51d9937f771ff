"""The replica side of the data plane: ``SocketShard``, a replica's handle on one shard, with
the actor's methods (``push_pull``, ``push_sync``, ``pull``) returning futures; one request in
flight at a time, run by a background thread so it overlaps compute, or, where only headers
cross the socket (shared memory), sent on the caller's thread with its reply read when asked
for (``InlineReply``)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import ssl
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .protocol import (
    MAGIC,
    MAX_ERROR,
    OP_PART,
    OP_PULL,
    OP_PUSH_PULL,
    OP_PUSH_SYNC,
    REP,
    REQ,
    RETRYABLE_REPLIES,
    WIRE_DTYPES,
    DataPlaneError,
    DataPlaneUnavailable,
    recv_bytes,
    recv_exact,
    tensor_view,
    tune,
)
from .rows import F_SPARSE, SparseBlock, encode, read_rows
from .shm import F_SHM, SHM_DIR, SharedParams, SharedSlots, unlink

logger = logging.getLogger(__name__)


class SocketShard:
    """A replica's handle on one shard over the socket data plane. Its methods mirror the actor's
    (``push_pull``, ``push_sync``, ``pull``) and return futures with ``.result(timeout=)``; one
    request is in flight at a time, run by a background thread so it overlaps compute.

    With ``shared_memory`` (the default) the replica offers the ps a shared-memory file in the
    handshake; when the ps is on the same machine and can map it, the buffers stay in that file
    and only the headers cross the socket (no kernel copies); otherwise the socket carries them.
    Where the ps also offers its parameters to read in place (sync without backup replicas:
    ``SharedParams``), the replies point there; ``in_place_views``: the model may compute on that
    read-only memory directly (a model that never writes its parameters: dtrain's layers), else
    each reply is copied into the replica's own buffer, on its own core."""

    def __init__(self, host: str, port: int, secret: bytes, replica: int, numel: int, timeout: float = 60.0,
                 ssl_context: ssl.SSLContext | None = None, wire_dtype: str = "float32",
                 shared_memory: bool = True, attempt: int = 0, tables: dict[str, int] | None = None,
                 in_place_views: bool = True):
        self.replica = replica
        self.tables = dict(tables or {})  # sparse tables on this shard: name -> row width
        self.wire = WIRE_DTYPES[wire_dtype]
        self.timeout = timeout
        self._sock = socket.create_connection((host, port), timeout=timeout)
        tune(self._sock, timeout)
        if ssl_context is not None:
            self._sock = ssl_context.wrap_socket(self._sock, server_hostname=host)
        try:
            magic = recv_bytes(self._sock, len(MAGIC))
            nonce = recv_bytes(self._sock, 16) if magic == MAGIC else b""
        except (OSError, DataPlaneError) as exc:
            self._sock.close()
            why = f"no answer in {timeout:.0f} s" if isinstance(exc, (TimeoutError, BlockingIOError)) else exc
            raise DataPlaneUnavailable(f"the ps at {host}:{port} did not open the data plane: {why}") from None
        if magic != MAGIC:
            self._sock.close()
            raise DataPlaneError(f"{host}:{port} is not a dtrain ps data plane (or another dtrain version)")
        digest = hmac.new(secret, nonce, hashlib.sha256).digest()
        self.shm: SharedSlots | None = None
        self.params: SharedParams | None = None  # the ps's parameters, read in place (sync)
        offer = SharedSlots.create(numel, self.wire) if shared_memory else None
        name = offer[1] if offer else ""
        try:
            self._sock.sendall(digest + struct.pack("<IIH", replica, attempt, len(name)) + name.encode()
                               + (offer[2] if offer else b""))
            answer = recv_bytes(self._sock, 1)
            if answer == b"\x03":  # and the ps's parameters to read in place: pid, fd, token
                pid, fd = struct.unpack("<II", recv_bytes(self._sock, 8))
                self.params = SharedParams.attach(pid, fd, recv_bytes(self._sock, 16), numel)
                self._sock.sendall(b"\x01" if self.params is not None else b"\x00")
        except (OSError, DataPlaneError) as exc:
            answer = b"timeout" if isinstance(exc, (TimeoutError, BlockingIOError)) else b""
            logger.info("data-plane handshake with %s:%d failed: %s", host, port, exc)
        finally:
            if offer:
                unlink(os.path.join(SHM_DIR, name))
        if answer not in (b"\x01", b"\x02", b"\x03"):
            if offer:
                offer[0].close()
            self._sock.close()
            if answer == b"timeout":
                raise DataPlaneUnavailable(f"no answer from the ps at {host}:{port} in {timeout:.0f} s (data-plane handshake)")
            raise DataPlaneError(f"the ps at {host}:{port} refused the data-plane handshake (a wrong per-run "
                                 "secret: is this replica from another run?)")
        if offer:
            if answer in (b"\x02", b"\x03"):
                self.shm = offer[0]
            else:
                offer[0].close()
        if self.shm is not None and ssl_context is not None:
            try:  # only headers cross this socket, on this machine: see protocol.py (TLS)
                assert isinstance(self._sock, ssl.SSLSocket)  # (wrapped above)
                self._sock.unwrap()
            except (OSError, ValueError) as exc:
                self.shm.close()
                self._sock.close()
                raise DataPlaneUnavailable(f"the ps at {host}:{port} did not end TLS for shared memory: {exc}") from None
        f32 = self.wire == torch.float32
        self._wire_out = None if f32 or self.shm is not None else torch.empty(numel, dtype=self.wire)
        self._wire_in = None if f32 or self.shm is not None else torch.empty(numel, dtype=self.wire)
        # Two persistent reply buffers (or shared slots): the replica computes on one while the
        # next reply may already be arriving in the other.
        self._bufs = [] if self.shm is not None and f32 and (self.params is None or in_place_views) else [
            torch.empty(numel, dtype=torch.float32) for _ in range(2)]
        self._next = 0
        self._part_error: DataPlaneError | None = None
        self._header = bytearray(REP.size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"dtrain-dp-r{replica}")
        # Requests on the caller's thread (see _submit): no hand-off to the pool's thread and back,
        # which cost more CPU than the round trip itself (docs/performance.md, "What made the difference").
        self._inline = self.shm is not None and f32
        self._unread: InlineReply | None = None

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
                   local_step: int, head: int | None = None, sparse: Mapping[str, Any] | None = None) -> tuple:
        reply = self._dense_roundtrip(op, grad, version, loss, samples, local_step, head, sparse)
        return reply if sparse is None else (*reply, self._rows(sparse))

    def _rows(self, sparse: Mapping[str, Any]) -> dict | torch.Tensor:
        """The rows of a reply to a request with a sparse block (after its dense part)."""
        try:
            return read_rows(self._sock, sparse, self.tables, self.wire)
        except (TimeoutError, BlockingIOError):
            raise DataPlaneUnavailable(f"no answer from the ps in {self.timeout:.0f} s") from None
        except OSError as exc:
            raise DataPlaneUnavailable(f"data-plane connection failed: {exc}") from None

    def _dense_roundtrip(self, op: int, grad: torch.Tensor | None, version: int, loss: float | None, samples: int,
                         local_step: int, head: int | None, sparse: Mapping[str, Any] | None) -> tuple[torch.Tensor, int, bool, int]:
        slot = self._request(op, grad, version, loss, samples, local_step, head, sparse)
        return self._answer(slot)

    def _request(self, op: int, grad: torch.Tensor | None, version: int, loss: float | None, samples: int,
                 local_step: int, head: int | None, sparse: Mapping[str, Any] | None) -> int:
        """Send one request (header, gradient bytes or slot, sparse block); returns its reply slot."""
        try:
            if self._part_error is not None:
                raise self._part_error
            loss_f = float("nan") if loss is None else loss
            slot = self._next
            self._next ^= 1
            sparse_flag = F_SPARSE if sparse is not None else 0
            block = encode(sparse, self.wire) if sparse is not None else []
            if self.shm is not None:  # the header and the sparse block in one call
                gslot = self._grad_slot(grad) if grad is not None else 0
                self._sock.sendall(b"".join([REQ.pack(op, F_SHM | gslot << 1 | slot << 2 | sparse_flag, 0,
                                                      self.replica, version, local_step, loss_f, samples, 0, 0),
                                             *block]))
            else:
                end = 0 if grad is None else grad.numel() if head is None else head
                self._send(op, grad, 0, end, version, local_step, loss_f, samples, sparse_flag)
                if block:
                    self._sock.sendall(b"".join(block))
            return slot
        except (TimeoutError, BlockingIOError):  # SO_SNDTIMEO expiry is EAGAIN
            raise DataPlaneUnavailable(f"the ps took no request in {self.timeout:.0f} s") from None
        except OSError as exc:
            raise DataPlaneUnavailable(f"data-plane connection failed: {exc}") from None

    def _answer(self, slot: int) -> tuple[torch.Tensor, int, bool, int]:
        """Receive the reply of the request answered into ``slot`` (its dense part)."""
        try:
            recv_exact(self._sock, memoryview(self._header))
            step, stop, error, _pad, generation, nbytes = REP.unpack(self._header)
            if error:
                if nbytes > MAX_ERROR:  # not allocated: the server is not authenticated
                    raise DataPlaneError(f"an error reply of {nbytes} bytes from the ps (at most {MAX_ERROR})")
                reply = recv_bytes(self._sock, nbytes).decode(errors="replace")
                raise (DataPlaneUnavailable if reply.startswith(RETRYABLE_REPLIES) else DataPlaneError)(reply)
            if self.shm is not None:
                if nbytes:
                    raise DataPlaneError(f"{nbytes} bytes of parameters on a shared-memory connection")
                src = self.shm.param[slot] if self.params is None else self.params.tensor
                if not self._bufs:
                    return src, step, bool(stop), generation
                buf = self._bufs[slot]
                buf.copy_(src)  # widened from bfloat16, or the ps's parameters for a model that writes its own
                return buf, step, bool(stop), generation
            buf = self._bufs[slot]
            target = buf if self._wire_in is None else self._wire_in
            view = tensor_view(target)
            if nbytes != len(view):
                raise DataPlaneError(f"parameters of {nbytes} bytes, expected {len(view)}")
            recv_exact(self._sock, view)
            if target is not buf:
                buf.copy_(target)
            return buf, step, bool(stop), generation
        except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO expiry is EAGAIN
            raise DataPlaneUnavailable(f"no answer from the ps in {self.timeout:.0f} s") from None
        except OSError as exc:
            raise DataPlaneUnavailable(f"data-plane connection failed: {exc}") from None

    def _submit(self, op: int, grad: torch.Tensor | None, version: int, loss: float | None, samples: int,
                local_step: int, head: int | None, sparse: Mapping[str, Any] | None) -> Future | InlineReply:
        """A request: sent on this thread with its reply read when asked for (shared memory, float32:
        only 48- and 24-byte headers, and a sparse block's ids, gradients and rows, cross the
        socket), else run by the background thread. A per-table ``sparse`` mapping becomes one
        :class:`~dtrain.dataplane.rows.SparseBlock` here, once: its request and its reply's rows
        read the same block."""
        if sparse is not None:
            sparse = SparseBlock.of(sparse)
        if not self._inline:
            return self._pool.submit(self._roundtrip, op, grad, version, loss, samples, local_step, head, sparse)
        if self._unread is not None:  # (one reply in flight per connection: read the last one first)
            self._unread.done(wait=True, timeout=None)
        reply = self._unread = InlineReply(self, sparse)
        try:
            reply.slot = self._request(op, grad, version, loss, samples, local_step, head, sparse)
        except DataPlaneError as exc:
            reply.error, self._unread = exc, None
        return reply

    @property
    def sends_parts(self) -> bool:
        """Whether buckets are worth sending early: the bytes cross the socket (no shared memory)."""
        return self.shm is None

    def _send(self, op: int, grad: torch.Tensor | None, start: int, end: int, version: int = 0,
              local_step: int = 0, loss: float = 0.0, samples: int = 0, flags: int = 0) -> None:
        """A request header and ``grad[start:end]`` in the wire dtype (narrowed here, on this
        thread, off the compute path), to be stored at that offset of the ps's gradient."""
        payload: bytes | memoryview = b""
        offset = 0
        if grad is not None and end > start:
            if self._wire_out is not None:
                self._wire_out[start:end].copy_(grad[start:end])
                grad = self._wire_out
            payload, offset = tensor_view(grad[start:end]), start * grad.element_size()
        self._sock.sendall(REQ.pack(op, flags, 0, self.replica, version, local_step, loss, samples, offset,
                                    len(payload)))
        if payload:
            self._sock.sendall(payload)

    def _send_part(self, grad: torch.Tensor, start: int, end: int) -> None:
        try:
            self._send(OP_PART, grad, start, end)
        except OSError as exc:
            self._part_error = DataPlaneUnavailable(f"data-plane connection failed: {exc}")

    def send_part(self, grad: torch.Tensor, start: int, end: int) -> None:
        """Send ``grad[start:end]`` now (a bucket whose gradients backward has finished), in order
        with the requests; the push that follows passes ``head`` and sends only ``grad[:head]``."""
        self._pool.submit(self._send_part, grad, start, end)

    def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0, head: int | None = None, sparse: Mapping[str, Any] | None = None) -> Future | InlineReply:
        """``head``: only ``grad[:head]`` still has to be sent (the rest went by :meth:`send_part`).
        ``sparse``: rows to push and to gather (``dtrain.ps.sparse``); the reply then has the rows."""
        return self._submit(OP_PUSH_PULL, grad, version, loss, samples, local_step, head, sparse)

    def push_sync(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None, samples: int = 0,
                  local_step: int = 0, head: int | None = None, sparse: Mapping[str, Any] | None = None) -> Future | InlineReply:
        return self._submit(OP_PUSH_SYNC, grad, version, loss, samples, local_step, head, sparse)

    def pull(self, min_step: int = 0, sparse: Mapping[str, Any] | None = None) -> Future | InlineReply:
        return self._submit(OP_PULL, None, min_step, None, 0, 0, None, sparse)

    def close(self) -> None:
        self._unread = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._sock.close()
        except OSError:
            pass
        if self.shm is not None:
            self.shm.close()
        self.params = None  # (no file to close on this side; the mapping goes with the model's views)


class InlineReply:
    """The reply to a request sent on the caller's thread (``SocketShard._submit``): read from the
    socket when ``result`` or ``done`` asks for it, meanwhile the ps works and the caller computes
    (the parameters land in the shared reply slot; only a 24-byte header waits in the socket).
    Quacks like the ``Future`` of the background thread's requests: ``result(timeout)``, ``done()``,
    ``exception(timeout)``."""

    __slots__ = ("shard", "sparse", "slot", "value", "error")

    def __init__(self, shard: SocketShard, sparse: Mapping[str, Any] | None = None):
        self.shard = shard
        self.sparse = sparse  # (the request's sparse block: the reply's rows follow its header)
        self.slot = 0
        self.value: tuple | None = None
        self.error: BaseException | None = None

    def done(self, wait: bool = False, timeout: float | None = 0.0) -> bool:
        """Whether the reply is in (read now if its first byte has arrived). ``wait``: block for it
        (``timeout`` seconds at most; None: the connection's own timeout)."""
        if self.value is not None or self.error is not None:
            return True
        sock = self.shard._sock
        if not wait or timeout is not None:
            ready = isinstance(sock, ssl.SSLSocket) and sock.pending() > 0
            if not ready:
                try:
                    ready = bool(select.select([sock], [], [], timeout or 0.0)[0])
                except (OSError, ValueError):  # closed meanwhile: the read below says how
                    ready = True
            if not ready:
                return False
        try:
            value: tuple = self.shard._answer(self.slot)
            if self.sparse is not None:
                value = (*value, self.shard._rows(self.sparse))
            self.value = value
        except DataPlaneError as exc:
            self.error = exc
        if self.shard._unread is self:
            self.shard._unread = None
        return True

    def result(self, timeout: float | None = None) -> tuple:
        if not self.done(wait=True, timeout=timeout):
            raise TimeoutError(f"no reply from the ps in {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done(wait=True, timeout=timeout):
            raise TimeoutError(f"no reply from the ps in {timeout} s")
        return self.error
