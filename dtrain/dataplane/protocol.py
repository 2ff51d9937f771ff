"""The socket data plane's protocol: flat parameter and gradient buffers over one persistent TCP connection
per replica and shard, with Dask kept as the control plane (``training.transport: socket``).

Why: with actor calls as the data plane every step pays Dask's framing, per-message buffer
allocation and thread hand-offs on the replica's own core (measured:
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
  ``HMAC-SHA256(secret, nonce)`` (32 bytes) + its replica index (u32) + its attempt id (u32: the
  session's submission of that replica; pushes from an attempt other than the one the session
  made the replica's owner, ``ParameterShard.set_owner``, are refused). A wrong answer closes the
  connection: only processes that got the per-run secret through Dask can push gradients. Then
  the client sends a u16 name length (0: no offer) + a /dev/shm file name + a 16-byte token that
  the file starts with; the server answers one byte (0: refused, 1: accepted, use the socket's
  bytes, 2: accepted and the file is mapped, 3: that, and the shard's parameters may be read in
  place). After 3 come the ps's pid (u32), the number of its parameters' memfd (u32) and that
  file's 16-byte token; the client maps ``/proc/<pid>/fd/<fd>`` read-only and answers one byte
  (1: mapped, and every reply's parameters are then in that file, not in a reply slot; 0: not,
  replies use the slots). The ps offers 3 only for sync replication without backup replicas
  (``ParameterShard.shares_params``; dataplane/shm.py, ``SharedParams``).
- TLS (a TLS cluster's data plane) covers the handshake and, on a socket's bytes, every request.
  After answer 2 both sides end the TLS session (``unwrap``: close_notify each way) and go on in
  the clear: gradients and parameters then travel through the replica's /dev/shm file, which TLS
  never covered, and only 48- and 24-byte headers cross the socket, between two processes of one
  machine (the ps could map the replica's file), whose traffic only root can read or forge —
  who can read the file too. It saves the replica and the ps a TLS record each way per step.
- request: header ``<B op, B flags, H pad, I replica, q version, q local_step, d loss, I samples,
  Q offset, Q nbytes>`` then ``nbytes`` of gradient in the wire dtype, to be stored at byte
  ``offset`` of the shard's gradient (op push_pull / push_sync / pull / part). ``part`` has no
  reply: it is a bucket sent while backward is still running (``training.bucket_mb``); the push
  that follows carries the rest of the gradient, usually its head, and applies the whole.
  ``flags``: bit 0 shared memory (``nbytes`` 0), bit 1 the gradient slot, bit 2 the reply slot.
- reply: header ``<q step, B stop, B error, H pad, I generation, Q nbytes>`` then the parameters
  (none with shared memory: they are in the reply slot); ``error`` replies carry a UTF-8
  message instead (at most ``MAX_ERROR`` bytes). A header the server cannot serve (an unknown
  op, a replica index beyond the run's, bytes outside the shard or not whole values, shared
  memory where there is none or on a ``part``, a fenced-off attempt) gets an error reply, then
  the server closes the connection.
- limits: the handshake has an absolute deadline; an authenticated connection has no idle
  timeout (keepalive instead); requests wait on the ps for the server's timeout, longer while a
  barrier grace runs.

The server runs each request on the worker's event loop (``run_coroutine_threadsafe``) through
the same ``ParameterShard`` methods as the actor path, so sync barriers, staleness and snapshots
behave identically; only the bytes travel differently. No Dask import here.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import struct

import torch

logger = logging.getLogger(__name__)

MAGIC = b"DTRN6"
REQ = struct.Struct("<BBHIqqdIQQ")
REP = struct.Struct("<qBBHIQ")
OP_PUSH_PULL, OP_PUSH_SYNC, OP_PULL, OP_PART = 1, 2, 3, 4
OPS = {OP_PUSH_PULL: "push_pull", OP_PUSH_SYNC: "push_sync"}
MAX_ERROR = 64 << 10  # the longest error message a client accepts (the server truncates to it)


class DataPlaneError(RuntimeError):
    """The data-plane connection failed (closed, timed out, refused the handshake)."""


class DataPlaneUnavailable(DataPlaneError):
    """The ps did not answer in time, the connection broke, or its sync barrier timed out: the
    session may retry (TF's UnavailableError), unlike a refused handshake or a malformed reply."""


RETRYABLE_REPLIES = ("BarrierTimeout:",)
"""Error replies of the ps (``type: message``) that say a retry may succeed."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    # MSG_WAITALL: the kernel fills the whole buffer in one call (one GIL release and re-acquire
    # per message instead of one per 64 KB chunk, which the compute thread would feel).
    flags = socket.MSG_WAITALL if not isinstance(sock, ssl.SSLSocket) else 0
    while len(view):
        n = sock.recv_into(view, len(view), flags)
        if n == 0:
            raise DataPlaneUnavailable("connection closed by the peer")
        view = view[n:]


def tune(sock: socket.socket, timeout: float) -> None:
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


def listen(host: str, who: str, backlog: int = 64) -> socket.socket:
    """A listener for peers that connect to ``host``: an IPv6 literal gets an IPv6 socket, and a
    host that is no local interface (a worker's contact address behind NAT or in a container,
    ``--contact-address``/``--listen-address``) the wildcard address of its family. ``who``
    names the listener in the log line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, 0), family=family, backlog=backlog)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    logger.info("%s: %s is no local address (a contact address?): listening on %s", who, host, wildcard)
    return socket.create_server((wildcard, 0), family=family, backlog=backlog)


def authenticated(sock: socket.socket) -> None:
    """The server's side of an authenticated connection: no receive timeout (a replica may load
    its data, build its model or run a long step between two requests), and TCP keepalive so a
    peer whose machine died is still found (about 2 min)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def tensor_view(t: torch.Tensor) -> memoryview:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same bytes as int16
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy declares the buffer protocol for Python 3.12+ only


ANSWERED = object()
"""What a direct push returns when its reply was already sent for it (by the push that completed
its sync step, through the ``respond`` callback the server gave it): nothing more to send."""


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------------- TLS


def _load_chain(ctx: ssl.SSLContext, cert_pem: str, key_pem: str | None) -> None:
    """load_cert_chain needs files. On Linux the PEMs go into anonymous memory files (memfd): no
    file on disk, so a process killed meanwhile leaves nothing behind (every embedded-cluster
    process does this since its data plane is TLS); elsewhere, a private temporary directory."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fds = []
        try:
            paths: list[str | None] = []
            for pem in (cert_pem, key_pem):
                if pem:
                    fd = os.memfd_create("dtrain-tls")
                    fds.append(fd)
                    os.write(fd, pem.encode())
                    paths.append(f"/proc/self/fd/{fd}")
                else:
                    paths.append(None)
            certfile = paths[0]
            assert certfile is not None  # (the certificate is given)
            ctx.load_cert_chain(certfile, paths[1])
        finally:
            for fd in fds:
                os.close(fd)
        return
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
    cert = tls.get("cert")
    if cert:
        _load_chain(ctx, cert, tls.get("key"))
    return ctx


def server_ssl_context(tls: dict[str, str | None]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=tls["ca"])
    cert = tls["cert"]
    assert cert is not None  # a ps serves with its certificate
    _load_chain(ctx, cert, tls.get("key"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
