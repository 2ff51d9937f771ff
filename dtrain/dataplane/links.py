"""Stage links: activations forward and their gradients back between the pipeline stages of one
replica (model parallelism, docs/pipeline.md). No Dask import here.

Stage ``p + 1`` listens (``StageListener``, opened by a small task on its worker before the stage
tasks start), stage ``p`` connects; one TCP connection per neighbouring pair carries both
directions. The handshake is the ps data plane's: the listener sends ``MAGIC`` and a nonce, the
connecting stage answers ``HMAC-SHA256(secret, nonce)`` with the run's per-run secret (which only
processes that got it through Dask hold); TLS wraps the socket when the cluster uses TLS.

Messages (little-endian): a header ``<B kind, B ntensors, H count, I microbatch, d loss>`` then each
tensor as ``<B dtype, B ndim, 6x pad>``, ``ndim`` int64 dims and its bytes. Kinds: FORWARD
(stage ``p``'s output and the labels), BACKWARD (the gradient of that output, and the
micro-batch's loss from the last stage), STOP (the first stage ends: no more steps). Each end
has a sender thread (a send never blocks the compute thread, so two stages can never deadlock
on full socket buffers) and a receiver thread filling a queue; the syscalls release the GIL and
overlap compute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass

import torch

from .protocol import DataPlaneError, authenticated, recv_bytes, recv_exact, tune

logger = logging.getLogger(__name__)

MAGIC = b"DTRNS1"
HEAD = struct.Struct("<BBHId")
TENSOR = struct.Struct("<BB6x")
FORWARD, BACKWARD, STOP = 1, 2, 3
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int16, torch.int8]
CODES = {d: i for i, d in enumerate(DTYPES)}
MAX_DIMS = 16


@dataclass
class Message:
    kind: int
    microbatch: int
    loss: float  # FORWARD: the micro-batch's share of the batch; BACKWARD: its weighted loss
    tensors: list[torch.Tensor]
    count: int = 0  # FORWARD: the step's micro-batches


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


class StageLink:
    """One end of a connection between neighbouring stages (see the module docstring)."""

    def __init__(self, sock: socket.socket, name: str, timeout: float):
        self._sock = sock
        self.name = name
        self.timeout = timeout
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.send_s = 0.0
        self._sender = threading.Thread(target=self._send_loop, name=f"dtrain-{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"dtrain-{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    # ------------------------------------------------------------------ sending
    def send(self, kind: int, microbatch: int = 0, tensors: tuple[torch.Tensor, ...] = (), loss: float = 0.0,
             count: int = 0) -> None:
        """Queue a message (the tensors must not change afterwards: they are sent as they are)."""
        self._out.put((kind, microbatch, loss, [t.detach() for t in tensors], count))

    def _send_loop(self) -> None:
        try:
            while True:
                item = self._out.get()
                if item is None:
                    return
                kind, mb, loss, tensors, count = item
                t0 = time.perf_counter()
                parts = [HEAD.pack(kind, len(tensors), count, mb, loss)]
                for t in tensors:
                    parts.append(TENSOR.pack(CODES[t.dtype], t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
                    parts.append(_as_bytes(t))
                for p in parts:
                    self._sock.sendall(p)
                    self.bytes_sent += len(p)
                self.send_s += time.perf_counter() - t0
        except OSError as exc:
            if not self._closed.is_set():
                logger.debug("stage link %s: send failed: %s", self.name, exc)
                self._in.put(DataPlaneError(f"stage link {self.name}: send failed: {exc}"))

    # ------------------------------------------------------------------ receiving
    def _recv_loop(self) -> None:
        try:
            while not self._closed.is_set():
                kind, n, count, mb, loss = HEAD.unpack(recv_bytes(self._sock, HEAD.size))
                if kind not in (FORWARD, BACKWARD, STOP):
                    raise DataPlaneError(f"unknown message kind {kind}")
                tensors = []
                for _ in range(n):
                    code, ndim = TENSOR.unpack(recv_bytes(self._sock, TENSOR.size))
                    if code >= len(DTYPES) or ndim > MAX_DIMS:
                        raise DataPlaneError(f"bad tensor header ({code}, {ndim})")
                    shape = struct.unpack(f"<{ndim}q", recv_bytes(self._sock, 8 * ndim)) if ndim else ()
                    if any(d < 0 for d in shape):
                        raise DataPlaneError(f"bad tensor shape {shape}")
                    dtype = DTYPES[code]
                    wire = torch.int16 if dtype == torch.bfloat16 else torch.uint8 if dtype == torch.bool else dtype
                    t = torch.empty(shape, dtype=wire)
                    if t.numel():
                        recv_exact(self._sock, memoryview(t.numpy()).cast("B"))
                    self.bytes_received += t.numel() * t.element_size()
                    tensors.append(t.view(dtype) if wire != dtype else t)
                self._in.put(Message(kind, mb, loss, tensors, count))
                if kind == STOP:
                    return
        except (OSError, DataPlaneError, struct.error) as exc:
            if not self._closed.is_set():
                self._in.put(DataPlaneError(f"stage link {self.name} closed by the peer ({exc}); is a stage's worker lost?"))

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; DataPlaneError when the link failed or nothing came within ``timeout``."""
        try:
            item = self._in.get(timeout=self.timeout if timeout is None else timeout)
        except queue.Empty:
            raise DataPlaneError(f"stage link {self.name}: no message in {self.timeout:.0f} s "
                                 "(training.call_timeout_s + barrier_timeout_s); is a stage lost?") from None
        if isinstance(item, BaseException):
            self._in.put(item)  # every later receive fails the same way
            raise item
        return item

    def close(self) -> None:
        """Send what is queued (briefly), then close."""
        self._out.put(None)
        self._sender.join(timeout=5)
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


# ---------------------------------------------------------------------------------- connecting


class StageListener:
    """A listening socket for the upstream stage's connection (on the downstream stage's worker)."""

    def __init__(self, host: str, secret: bytes, ssl_context: ssl.SSLContext | None = None):
        self.secret = secret
        self.ssl_context = ssl_context
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(4)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.created = time.monotonic()

    def accept(self, name: str, timeout: float) -> StageLink:
        """The upstream stage's authenticated connection (others are refused and closed)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataPlaneError(f"stage link {name}: the upstream stage did not connect in {timeout:.0f} s")
                self._sock.settimeout(min(left, 1.0))
                try:
                    sock, _ = self._sock.accept()
                except TimeoutError:
                    continue
                try:
                    sock = self._handshake(sock, min(10.0, timeout))
                except (OSError, DataPlaneError) as exc:
                    logger.warning("stage link %s: refused a connection: %s", name, exc)
                    sock.close()
                    continue
                tune(sock, timeout)
                authenticated(sock)  # no receive timeout: receive() has the deadline
                return StageLink(sock, name, timeout)
        finally:
            self.close()

    def _handshake(self, sock: socket.socket, timeout: float) -> socket.socket:
        sock.settimeout(timeout)
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True)
        nonce = os.urandom(16)
        sock.sendall(MAGIC + nonce)
        answer = recv_bytes(sock, 32)
        if not hmac.compare_digest(answer, hmac.new(self.secret, nonce, hashlib.sha256).digest()):
            raise DataPlaneError("wrong secret")
        sock.sendall(b"\x01")
        return sock

    def close(self) -> None:
        self._sock.close()


def connect(host: str, port: int, secret: bytes, name: str, timeout: float,
            ssl_context: ssl.SSLContext | None = None) -> StageLink:
    """The upstream end: connect to the downstream stage's listener and authenticate."""
    sock = socket.create_connection((host, port), timeout=min(timeout, 30.0))
    try:
        sock.settimeout(min(timeout, 30.0))
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        head = recv_bytes(sock, len(MAGIC) + 16)
        if head[:len(MAGIC)] != MAGIC:
            raise DataPlaneError(f"{host}:{port} is not a dtrain stage link")
        sock.sendall(hmac.new(secret, head[len(MAGIC):], hashlib.sha256).digest())
        if recv_bytes(sock, 1) != b"\x01":
            raise DataPlaneError(f"stage link {name}: the handshake was refused")
    except (OSError, DataPlaneError):
        sock.close()
        raise
    tune(sock, timeout)
    authenticated(sock)
    return StageLink(sock, name, timeout)
