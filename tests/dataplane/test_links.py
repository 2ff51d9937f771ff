"""Stage links on real sockets (127.0.0.1): messages both ways with their tensors intact, the
HMAC handshake refusing a wrong secret, and a closed peer reported to the waiting stage."""

from __future__ import annotations

import threading

import pytest
import torch

from dtrain.dataplane.links import BACKWARD, FORWARD, STOP, StageListener, connect
from dtrain.dataplane.protocol import DataPlaneError

SECRET = b"s" * 32


def pair(secret: bytes = SECRET, timeout: float = 5.0):
    listener = StageListener("127.0.0.1", SECRET)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("down", _accept(listener, timeout)))
    t.start()
    try:
        up = connect("127.0.0.1", listener.port, secret, "test 0->1", timeout)
    finally:
        t.join()
    return up, out["down"]


def _accept(listener, timeout):
    try:
        return listener.accept("test 0->1", timeout)
    except DataPlaneError as exc:
        return exc


def test_messages_cross_both_ways_intact():
    up, down = pair()
    try:
        act = torch.randn(5, 3, dtype=torch.float32)
        labels = torch.tensor([1, 0, 2, 2, 9])
        up.send(FORWARD, 3, (act, labels), loss=0.25, count=4)
        msg = down.receive()
        assert (msg.kind, msg.microbatch, msg.loss, msg.count) == (FORWARD, 3, 0.25, 4)
        assert torch.equal(msg.tensors[0], act) and torch.equal(msg.tensors[1], labels)
        assert msg.tensors[1].dtype == torch.int64
        down.send(BACKWARD, 3, (torch.ones(5, 3, dtype=torch.bfloat16),), loss=1.5)
        back = up.receive()
        assert back.kind == BACKWARD and back.loss == 1.5 and back.tensors[0].dtype == torch.bfloat16
        assert torch.equal(back.tensors[0].float(), torch.ones(5, 3))
        up.send(STOP)
        assert down.receive().kind == STOP
        assert up.bytes_sent > act.numel() * 4 and down.bytes_received >= act.numel() * 4 + 5 * 8
    finally:
        up.close()
        down.close()


def test_a_wrong_secret_is_refused():
    listener = StageListener("127.0.0.1", SECRET)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _accept(listener, 2.0)))
    t.start()
    with pytest.raises((DataPlaneError, OSError)):
        link = connect("127.0.0.1", listener.port, b"x" * 32, "intruder", 2.0)
        link.receive(timeout=2.0)  # never reached when the handshake already failed
    t.join()
    assert isinstance(out["r"], DataPlaneError)  # the listener never handed out a link


def test_a_closed_peer_fails_the_waiting_stage():
    up, down = pair()
    up.close()
    with pytest.raises(DataPlaneError, match="closed by the peer"):
        down.receive(timeout=5)
    down.close()


def test_shared_memory_carries_the_tensors_and_the_socket_only_headers():
    import os

    from dtrain.dataplane.shm import SHM_DIR

    before = {n for n in os.listdir(SHM_DIR) if n.startswith("dtrain-")}
    shape = (4, 4096)  # 4 micro-batches of up to 4096 bytes
    listener = StageListener("127.0.0.1", SECRET, shm=shape)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("down", listener.accept("shm 0->1", 5.0)))
    t.start()
    up = connect("127.0.0.1", listener.port, SECRET, "shm 0->1", 5.0, shm=shape)
    t.join()
    down = out["down"]
    try:
        assert up.slots is not None and down.slots is not None
        assert {n for n in os.listdir(SHM_DIR) if n.startswith("dtrain-")} == before  # unlinked once mapped
        for step in range(3):  # the step parity alternates the regions; every value arrives intact
            acts = [torch.full((8, 16), float(step * 10 + i)) for i in range(4)]
            for i, a in enumerate(acts):
                up.send(FORWARD, i, (a, torch.arange(8)), loss=0.25, count=4)
            for i, a in enumerate(acts):
                msg = down.receive()
                assert msg.microbatch == i and torch.equal(msg.tensors[0], a) and torch.equal(msg.tensors[1], torch.arange(8))
                down.send(BACKWARD, i, (a * 2,), loss=float(i))
            for i, a in enumerate(acts):
                back = up.receive()
                assert back.microbatch == i and torch.equal(back.tensors[0], a * 2)
        big = torch.ones(64, 64)  # 16 KiB: more than a region holds, so it crosses the socket
        up.send(FORWARD, 0, (big, torch.arange(64)), count=1)
        assert torch.equal(down.receive().tensors[0], big)
        # Headers only: far fewer bytes on the socket than the 3 x 4 x 2 tensors of 512+ bytes.
        assert up.bytes_sent < 3 * 4 * 400 + big.numel() * 4 + 2000
    finally:
        up.close()
        down.close()


def test_without_a_shape_the_listener_declines_the_offer():
    listener = StageListener("127.0.0.1", SECRET)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("down", listener.accept("no shm", 5.0)))
    t.start()
    up = connect("127.0.0.1", listener.port, SECRET, "no shm", 5.0, shm=(2, 1024))
    t.join()
    try:
        assert up.slots is None and out["down"].slots is None
        up.send(FORWARD, 0, (torch.ones(3),), count=1)
        assert torch.equal(out["down"].receive().tensors[0], torch.ones(3))
    finally:
        up.close()
        out["down"].close()


def test_a_dripping_connection_does_not_keep_the_upstream_stage_out():
    """The listener ran each handshake inline, with per-read timeouts: one unauthenticated socket
    sending a byte now and then (anyone who can reach the port) held it, and the real upstream
    stage's connect failed. Handshakes now run beside the accept loop, with an absolute deadline."""
    import socket
    import time

    listener = StageListener("127.0.0.1", SECRET)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("down", _accept(listener, 20.0)))
    t.start()
    drip = socket.create_connection(("127.0.0.1", listener.port))
    stop = threading.Event()

    def dripping() -> None:
        while not stop.is_set():
            try:
                drip.send(b"x")
            except OSError:
                return
            time.sleep(0.2)

    dripper = threading.Thread(target=dripping)
    dripper.start()
    up = None
    try:
        time.sleep(0.3)  # the drip is in its handshake
        up = connect("127.0.0.1", listener.port, SECRET, "test 0->1", 3.0)
        t.join(10)
        down = out["down"]
        assert not isinstance(down, BaseException), down
        up.send(STOP)
        assert down.receive(timeout=5).kind == STOP
        down.close()
    finally:
        stop.set()
        dripper.join()
        drip.close()
        t.join()
        if up is not None:
            up.close()


def test_a_contact_host_that_is_no_local_address_listens_on_the_wildcard():
    """A worker's contact address behind NAT or in a container (``--contact-address``) is no local
    interface: binding it failed with EADDRNOTAVAIL, and so did every model-parallel run there. The
    listener falls back to the wildcard address (as the ps data plane does) and still gives the
    contact host to the upstream stage."""
    listener = StageListener("203.0.113.7", SECRET)  # (TEST-NET-3: never a local address)
    try:
        assert listener.host == "203.0.113.7"
        assert listener._sock.getsockname()[0] == "0.0.0.0"
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("down", _accept(listener, 5.0)))
        t.start()
        up = connect("127.0.0.1", listener.port, SECRET, "test 0->1", 5.0)
        t.join()
        assert not isinstance(out["down"], BaseException), out["down"]
        up.close()
        out["down"].close()
    finally:
        listener.close()


def test_a_tensor_header_past_the_size_limit_fails_the_link_naming_it():
    """A received tensor's shape was allocated as it came (an authenticated but broken peer could
    ask for any size): past MAX_TENSOR_BYTES it fails the link with a message naming the size,
    instead of killing the receiver thread and leaving the stage waiting out its timeout."""
    import struct

    from dtrain.dataplane.links import HEAD, TENSOR

    up, down = pair()
    try:
        up._sock.sendall(HEAD.pack(FORWARD, 1, 1, 0, 0.0) + TENSOR.pack(0, 2, 0) + struct.pack("<2q", 2**40, 2**40))
        with pytest.raises(DataPlaneError, match="past the limit"):
            down.receive(timeout=3)
    finally:
        up.close()
        down.close()
