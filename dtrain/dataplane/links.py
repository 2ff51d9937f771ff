"""Stage links: activations forward and their gradients back between the pipeline stages of one
replica (model parallelism, docs/pipeline.md). No Dask import here.

Stage ``p + 1`` listens (``StageListener``, opened by a small task on its worker before the stage
tasks start), stage ``p`` connects; one TCP connection per neighbouring pair carries both
directions. The handshake is the ps data plane's: the listener sends ``MAGIC`` and a nonce, the
connecting stage answers ``HMAC-SHA256(secret, nonce)`` with the run's per-run secret (which only
processes that got it through Dask hold); TLS wraps the socket when the cluster uses TLS.

Messages (little-endian): a header ``<B kind, B ntensors, H count, I microbatch, d loss>`` then each
tensor as ``<B dtype, B ndim, B where, 5x pad>``, ``ndim`` int64 dims and, unless ``where`` is 1,
its bytes.

Same machine: the connecting stage offers a shared-memory file in the handshake (its name and a
token, as the ps data plane's replicas do: ``shm.SharedSlots``); when the listener can map it, a
message's tensors go into the file and only the headers cross the socket (``where`` 1). The file
holds, per direction and per step parity, one region per micro-batch of ``capacity`` bytes (what
the plan says one micro-batch's activations and labels take); a message that does not fit goes
over the socket. A region is written again only two steps later, by which time its reader has
long copied it out: the pipeline's own order (no step starts before the last one's gradients
came back) keeps every access safe. Kinds: FORWARD
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
import math
import os
import queue
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass

import torch

from .protocol import DataPlaneError, authenticated, listen, recv_bytes, recv_exact, tune
from .shm import SHM_DIR, SharedSlots, unlink

logger = logging.getLogger(__name__)

MAGIC = b"DTRNS1"
HEAD = struct.Struct("<BBHId")
TENSOR = struct.Struct("<BBB5x")
ALIGN = 64
FORWARD, BACKWARD, STOP = 1, 2, 3
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int16, torch.int8]
CODES = {d: i for i, d in enumerate(DTYPES)}
MAX_DIMS = 16
MAX_TENSOR_BYTES = 2**31  # one received tensor, at most (checked before it is allocated)
MAX_PENDING = 16  # connections in their handshake at once on a stage listener; a new one closes the oldest


@dataclass
class Message:
    kind: int
    microbatch: int
    loss: float  # FORWARD: the micro-batch's share of the batch; BACKWARD: its weighted loss
    tensors: list[torch.Tensor]
    count: int = 0  # FORWARD: the step's micro-batches


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class LinkSlots:
    """A link's shared-memory regions (see the module docstring): ``SharedSlots``' two "gradient"
    slots carry FORWARD messages (one per step parity), its two "parameter" slots BACKWARD ones."""

    def __init__(self, shared: SharedSlots, microbatches: int, capacity: int):
        self.shared, self.microbatches, self.capacity = shared, microbatches, capacity

    @staticmethod
    def numel(microbatches: int, capacity: int) -> int:
        return microbatches * capacity

    def region(self, kind: int, parity: int, microbatch: int) -> torch.Tensor:
        base = (self.shared.grad if kind == FORWARD else self.shared.param)[parity]
        return base[microbatch * self.capacity:(microbatch + 1) * self.capacity]

    def close(self) -> None:
        self.shared.close()


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]  # numpy: the buffer protocol for 3.12+ only


class StageLink:
    """One end of a connection between neighbouring stages (see the module docstring)."""

    def __init__(self, sock: socket.socket, name: str, timeout: float, slots: LinkSlots | None = None,
                 first_timeout: float | None = None):
        self._sock = sock
        self.name = name
        self.slots = slots  # shared memory with the neighbour (same machine), else None
        # The first message waits out the neighbour's start (its model, its first batch, its first
        # pull, the stages beyond it): training.stage_start_timeout_s; the later ones ``timeout``.
        self.first_timeout = timeout if first_timeout is None else first_timeout
        self._started = False  # a message has come
        self._parity = {FORWARD: 1, BACKWARD: 1}  # the step parity of the last message sent/received
        self._recv_parity = {FORWARD: 1, BACKWARD: 1}
        self.timeout = timeout
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.bytes_sent = 0  # on the socket: headers and the tensors that did not go through shared memory
        self.bytes_received = 0  # tensor bytes received on the socket
        self.bytes_shared = 0  # tensor bytes sent through shared memory
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
                parts: list[bytes | memoryview] = [HEAD.pack(kind, len(tensors), count, mb, loss)]
                data = [_as_bytes(t) for t in tensors]
                region = self._region(kind, mb, sum(_align(len(d)) for d in data), self._parity)
                off = 0
                for t, d in zip(tensors, data, strict=True):
                    parts.append(TENSOR.pack(CODES[t.dtype], t.dim(), region is not None)
                                 + struct.pack(f"<{t.dim()}q", *t.shape))
                    if region is None:
                        parts.append(d)
                    elif len(d):
                        region[off:off + len(d)].copy_(torch.frombuffer(d, dtype=torch.uint8))
                        off += _align(len(d))
                        self.bytes_shared += len(d)
                for p in parts:
                    self._sock.sendall(p)
                    self.bytes_sent += len(p)
                self.send_s += time.perf_counter() - t0
        except OSError as exc:
            if not self._closed.is_set():
                logger.debug("stage link %s: send failed: %s", self.name, exc)
                self._in.put(DataPlaneError(f"stage link {self.name}: send failed: {exc}"))

    def _region(self, kind: int, mb: int, nbytes: int, parity: dict[int, int]) -> torch.Tensor | None:
        """The shared-memory region of this message (None: it travels over the socket). Each
        direction's step parity flips at its micro-batch 0, on the sending and the receiving side alike."""
        if kind not in parity:
            return None
        if mb == 0:
            parity[kind] ^= 1
        if self.slots is None or mb >= self.slots.microbatches or nbytes > self.slots.capacity:
            return None
        return self.slots.region(kind, parity[kind], mb)

    # ------------------------------------------------------------------ receiving
    def _recv_loop(self) -> None:
        try:
            while not self._closed.is_set():
                kind, n, count, mb, loss = HEAD.unpack(recv_bytes(self._sock, HEAD.size))
                if kind not in (FORWARD, BACKWARD, STOP):
                    raise DataPlaneError(f"unknown message kind {kind}")
                tensors = []
                region = self._region(kind, mb, 0, self._recv_parity) if kind in (FORWARD, BACKWARD) else None
                off = 0
                for _ in range(n):
                    code, ndim, where = TENSOR.unpack(recv_bytes(self._sock, TENSOR.size))
                    if code >= len(DTYPES) or ndim > MAX_DIMS or where > 1 or (where and region is None):
                        raise DataPlaneError(f"bad tensor header ({code}, {ndim}, {where})")
                    shape = struct.unpack(f"<{ndim}q", recv_bytes(self._sock, 8 * ndim)) if ndim else ()
                    if any(d < 0 for d in shape):
                        raise DataPlaneError(f"bad tensor shape {shape}")
                    dtype = DTYPES[code]
                    wire = torch.int16 if dtype == torch.bfloat16 else torch.uint8 if dtype == torch.bool else dtype
                    size = math.prod(shape) * wire.itemsize
                    if size > MAX_TENSOR_BYTES:
                        raise DataPlaneError(f"a tensor of shape {list(shape)} ({size} bytes), past the limit of "
                                             f"{MAX_TENSOR_BYTES} bytes")
                    t = torch.empty(shape, dtype=wire)
                    nbytes = t.numel() * t.element_size()
                    if where and nbytes:
                        if off + nbytes > region.numel():  # type: ignore[union-attr]
                            raise DataPlaneError(f"a tensor of {nbytes} bytes past its shared region")
                        t.view(-1).view(torch.uint8).copy_(region[off:off + nbytes])  # type: ignore[index]
                        off += _align(nbytes)
                    elif nbytes:
                        recv_exact(self._sock, memoryview(t.numpy()).cast("B"))  # type: ignore[arg-type]  # (numpy: 3.12+)
                        self.bytes_received += nbytes
                    tensors.append(t.view(dtype) if wire != dtype else t)
                self._in.put(Message(kind, mb, loss, tensors, count))
                if kind == STOP:
                    return
        except (OSError, DataPlaneError, struct.error) as exc:
            if not self._closed.is_set():
                self._in.put(DataPlaneError(f"stage link {self.name} closed by the peer ({exc}); is a stage's worker lost?"))

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; DataPlaneError when the link failed or nothing came within ``timeout``
        (default: ``first_timeout`` for the link's first message, ``timeout`` for the others)."""
        first = not self._started
        if timeout is None:
            timeout = self.first_timeout if first else self.timeout
        try:
            item = self._in.get(timeout=timeout)
        except queue.Empty:
            start = first and timeout == self.first_timeout != self.timeout
            what = "training.stage_start_timeout_s: the neighbour's start" if start else \
                "training.call_timeout_s + barrier_timeout_s"
            raise DataPlaneError(f"stage link {self.name}: no message in {timeout:.0f} s ({what}); "
                                 "is a stage lost?") from None
        if isinstance(item, BaseException):
            self._in.put(item)  # every later receive fails the same way
            raise item
        self._started = True
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
        if self.slots is not None:
            self.slots.close()


# ---------------------------------------------------------------------------------- connecting


class StageListener:
    """A listening socket for the upstream stage's connection (on the downstream stage's worker).

    Anyone who can reach the port can connect: each connection's handshake runs on a thread of its
    own with an absolute deadline (a socket that drips a byte at a time cannot hold the listener),
    at most ``MAX_PENDING`` at once (a new one closes the oldest), and the first connection that
    authenticates is the link; the others are closed."""

    def __init__(self, host: str, secret: bytes, ssl_context: ssl.SSLContext | None = None,
                 shm: tuple[int, int] | None = None):
        self.secret = secret
        self.shm = shm  # (micro-batches, capacity): accept a shared-memory offer of that shape
        self.ssl_context = ssl_context
        self._sock = listen(host, "stage link", backlog=4)  # (the wildcard for a contact address)
        self.host, self.port = host, self._sock.getsockname()[1]  # the upstream stage connects to ``host``

    def accept(self, name: str, timeout: float, first_timeout: float | None = None) -> StageLink:
        """The upstream stage's authenticated connection (others are refused and closed).
        ``first_timeout``: the link's wait for its first message (``StageLink``)."""
        deadline = time.monotonic() + timeout
        handshake_s = min(10.0, timeout)
        lock = threading.Lock()
        pending: dict[socket.socket, float] = {}  # a duplicate of each socket in its handshake -> deadline
        won: queue.Queue = queue.Queue()
        done = threading.Event()

        def handshake(sock: socket.socket, cut: socket.socket) -> None:
            try:
                sock, slots = self._handshake(sock, handshake_s)
            except (OSError, DataPlaneError, ValueError) as exc:
                if not done.is_set():
                    logger.warning("stage link %s: refused a connection: %s", name, exc)
                sock.close()
                return
            finally:
                with lock:
                    pending.pop(cut, None)
                cut.close()
            with lock:
                late = done.is_set()
                if not late:
                    won.put((sock, slots))
            if late:  # another connection won meanwhile
                sock.close()
                if slots is not None:
                    slots.close()

        try:
            while True:
                try:
                    sock, slots = won.get_nowait()
                    break
                except queue.Empty:
                    pass
                now = time.monotonic()
                if now >= deadline:
                    raise DataPlaneError(f"stage link {name}: the upstream stage did not connect in {timeout:.0f} s")
                with lock:
                    overdue = [c for c, d in pending.items() if d < now]
                for c in overdue:
                    _shutdown(c)  # its handshake thread ends
                self._sock.settimeout(min(deadline - now, 0.05))
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # EMFILE...: transient, keep listening
                    logger.warning("stage link %s: accept failed: %s", name, exc)
                    time.sleep(0.1)
                    continue
                cut = conn.dup()  # (shut down from here: the TLS wrap detaches ``conn``)
                with lock:
                    oldest = min(pending, key=pending.__getitem__) if len(pending) >= MAX_PENDING else None
                    pending[cut] = now + handshake_s
                if oldest is not None:
                    _shutdown(oldest)
                try:
                    threading.Thread(target=handshake, args=(conn, cut), daemon=True,
                                     name=f"dtrain-{name}-handshake").start()
                except RuntimeError as exc:  # can't start new thread
                    logger.warning("stage link %s: connection dropped: %s", name, exc)
                    with lock:
                        pending.pop(cut, None)
                    cut.close()
                    conn.close()
        finally:
            with lock:
                done.set()
                rest = list(pending)
            for c in rest:
                _shutdown(c)
            self.close()
            while not won.empty():  # one that authenticated as the deadline passed: nobody takes it
                extra, extra_slots = won.get_nowait()
                extra.close()
                if extra_slots is not None:
                    extra_slots.close()
        tune(sock, timeout)
        authenticated(sock)  # no receive timeout: receive() has the deadline
        return StageLink(sock, name, timeout, slots, first_timeout)

    def _handshake(self, sock: socket.socket, timeout: float) -> tuple[socket.socket, LinkSlots | None]:
        sock.settimeout(timeout)
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True)
        nonce = os.urandom(16)
        sock.sendall(MAGIC + nonce)
        answer = recv_bytes(sock, 32)
        if not hmac.compare_digest(answer, hmac.new(self.secret, nonce, hashlib.sha256).digest()):
            raise DataPlaneError("wrong secret")
        (length,) = struct.unpack("<H", recv_bytes(sock, 2))
        slots = None
        if length:
            name, token = recv_bytes(sock, length).decode("ascii", "replace"), recv_bytes(sock, 16)
            if self.shm is not None:
                shared = SharedSlots.attach(name, token, LinkSlots.numel(*self.shm), torch.uint8)
                slots = LinkSlots(shared, *self.shm) if shared is not None else None
        sock.sendall(b"\x02" if slots is not None else b"\x01")
        return sock, slots

    def close(self) -> None:
        self._sock.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def connect(host: str, port: int, secret: bytes, name: str, timeout: float,
            ssl_context: ssl.SSLContext | None = None, shm: tuple[int, int] | None = None,
            first_timeout: float | None = None) -> StageLink:
    """The upstream end: connect to the downstream stage's listener and authenticate. ``shm``:
    (micro-batches, capacity) of a shared-memory file to offer (used when the listener maps it).
    ``first_timeout``: the link's wait for its first message (``StageLink``)."""
    sock = socket.create_connection((host, port), timeout=min(timeout, 30.0))
    offer = SharedSlots.create(LinkSlots.numel(*shm), torch.uint8) if shm is not None else None
    try:
        sock.settimeout(min(timeout, 30.0))
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        head = recv_bytes(sock, len(MAGIC) + 16)
        if head[:len(MAGIC)] != MAGIC:
            raise DataPlaneError(f"{host}:{port} is not a dtrain stage link")
        file = offer[1].encode() if offer else b""
        sock.sendall(hmac.new(secret, head[len(MAGIC):], hashlib.sha256).digest() + struct.pack("<H", len(file))
                     + file + (offer[2] if offer else b""))
        answer = recv_bytes(sock, 1)
        if answer not in (b"\x01", b"\x02"):
            raise DataPlaneError(f"stage link {name}: the handshake was refused")
    except (OSError, DataPlaneError):
        sock.close()
        if offer:
            offer[0].close()
        raise
    finally:
        if offer:
            unlink(os.path.join(SHM_DIR, offer[1]))  # mapped by both, or not wanted: gone either way
    slots = None
    if offer and answer == b"\x02":
        slots = LinkSlots(offer[0], *shm)  # type: ignore[misc]
    elif offer:
        offer[0].close()
    tune(sock, timeout)
    authenticated(sock)
    return StageLink(sock, name, timeout, slots, first_timeout)
