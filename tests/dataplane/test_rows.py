"""dtrain.dataplane.rows: a request's sparse block and a reply's rows over a real socket pair,
in float32 and bfloat16 on the wire, and lengths the server must refuse before reading on."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from dtrain.dataplane import rows

DIMS = {"0.weight": 3}


def send(sock: socket.socket, buffers) -> None:
    for b in buffers:
        sock.sendall(b)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_request_and_rows_round_trip(wire):
    a, b = socket.socketpair()
    with a, b:
        grads = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
        sparse = {"0.weight": (torch.tensor([1, 5, 9, 40]), grads, torch.tensor([2, 5]))}
        send(a, rows.encode(sparse, wire))
        got = rows.read_request(b, DIMS, wire)
        ids, g, want = got["0.weight"]
        assert torch.equal(ids, torch.tensor([1, 5, 9, 40])) and torch.equal(want, torch.tensor([2, 5]))
        assert g.dtype == torch.float32 and torch.equal(g, grads.to(wire).to(torch.float32))
        if wire == torch.bfloat16:
            assert not torch.equal(g, grads)  # really rounded: 2 bytes a value crossed the socket
        table = torch.randn(2, 3)
        send(b, rows.encode_rows(got, {"0.weight": table}, DIMS, wire))
        back = rows.read_rows(a, sparse, DIMS, wire)
        assert torch.equal(back["0.weight"], table.to(wire).to(torch.float32))


def test_an_empty_push_and_an_empty_want_travel():
    a, b = socket.socketpair()
    with a, b:
        sparse = {"0.weight": (None, None, torch.tensor([7]))}
        send(a, rows.encode(sparse, torch.float32))
        ids, g, want = rows.read_request(b, DIMS, torch.float32)["0.weight"]
        assert ids.numel() == 0 and g is None and torch.equal(want, torch.tensor([7]))
        send(b, rows.encode_rows(sparse, {}, DIMS, torch.float32))  # the ps failed: an empty block
        assert rows.read_rows(a, sparse, DIMS, torch.float32) == {}


@pytest.mark.parametrize(("block", "match"), [
    (struct.pack("<Q", rows.MAX_BLOCK + 1), "at most"),
    (struct.pack("<Q", 4 + rows._ENTRY.size + 5) + struct.pack("<I", 1) + rows._ENTRY.pack(5, 0, 1, 3) + b"other",
     "no table 'other' on this ps task"),
    (struct.pack("<Q", 4 + rows._ENTRY.size + 8) + struct.pack("<I", 1) + rows._ENTRY.pack(8, 1, 0, 2) + b"0.weight",
     "rows of width 2, the table's is 3"),
    (struct.pack("<Q", 999) + struct.pack("<I", 1) + rows._ENTRY.pack(8, 1, 0, 3) + b"0.weight",
     "a sparse block of 999 bytes whose entries need"),
])
def test_bad_blocks_are_refused_from_their_header(block, match):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(block)
        with pytest.raises(ValueError, match=match):
            rows.read_request(b, DIMS, torch.float32)
