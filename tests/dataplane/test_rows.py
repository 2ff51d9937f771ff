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
        back = rows.read_rows(a, sparse, DIMS, wire)  # one width: every row side by side
        assert isinstance(back, torch.Tensor) and torch.equal(back, table.to(wire).to(torch.float32))


def test_several_tables_of_odd_widths_keep_their_bytes_apart():
    """bfloat16 rows of width 3 end off an 8-byte boundary: the padding keeps the next table's
    ids readable (a block laid out without it shifts every later tensor)."""
    dims = {"a": 3, "b": 5, "c": 3}
    g = torch.Generator().manual_seed(1)
    sparse = {"a": (torch.tensor([1, 2, 3]), torch.randn(3, 3, generator=g), torch.tensor([4])),
              "b": (torch.tensor([7]), torch.randn(1, 5, generator=g), torch.tensor([8, 9, 10])),
              "c": (None, None, torch.tensor([11, 12]))}
    a, b = socket.socketpair()
    with a, b:
        send(a, rows.encode(sparse, torch.bfloat16))
        got = rows.read_request(b, dims, torch.bfloat16)
        assert list(got) == ["a", "b", "c"]
        for name, (ids, grads, want) in sparse.items():
            r_ids, r_grads, r_want = got[name]
            assert torch.equal(r_ids, ids if ids is not None else torch.empty(0, dtype=torch.int64))
            assert torch.equal(r_want, want)
            if grads is None:  # pushes nothing while the others push: no rows of gradients
                assert r_grads.shape == (0, dims[name])
            else:
                assert torch.equal(r_grads, grads.to(torch.bfloat16).to(torch.float32))
        back = {name: torch.randn(len(want), dims[name], generator=g) for name, (_i, _g, want) in sparse.items()}
        send(b, rows.encode_rows(got, back, dims, torch.bfloat16))
        out = rows.read_rows(a, sparse, dims, torch.bfloat16)  # widths differ: per table
        assert isinstance(out, dict)
        for name, t in back.items():
            assert torch.equal(out[name], t.to(torch.bfloat16).to(torch.float32))


def test_an_empty_push_and_an_empty_want_travel():
    a, b = socket.socketpair()
    with a, b:
        sparse = {"0.weight": (None, None, torch.tensor([7]))}
        send(a, rows.encode(sparse, torch.float32))
        ids, g, want = rows.read_request(b, DIMS, torch.float32)["0.weight"]
        assert ids.numel() == 0 and g is None and torch.equal(want, torch.tensor([7]))
        send(b, rows.encode_rows(sparse, {}, DIMS, torch.float32))  # the ps failed: an empty block
        assert rows.read_rows(a, sparse, DIMS, torch.float32) == {}


def _block(head: bytes, count: int = 1, length: int | None = None) -> bytes:
    """A block's first bytes: its length (by default the table count and the head alone), the table
    count and the head (padded to 8 bytes)."""
    head += bytes(-len(head) % 8)
    return struct.pack("<QII", 8 + len(head) if length is None else length, count, len(head)) + head


@pytest.mark.parametrize(("block", "match"), [
    (struct.pack("<QII", rows.MAX_BLOCK + 1, 1, 0), "at most"),
    (_block(rows._ENTRY.pack(5, 0, 1, 3) + b"other"), "no table 'other' on this ps task"),
    (_block(rows._ENTRY.pack(8, 1, 0, 2) + b"0.weight"), "rows of width 2, the table's is 3"),
    (_block(rows._ENTRY.pack(8, 1, 0, 3) + b"0.weight", length=999), "a sparse block of 999 bytes whose entries need"),
    (_block(rows._ENTRY.pack(8, 1, 0, 3) + b"0.weight", count=2), "shorter than its entries"),
    (struct.pack("<QII", 64, 1, 12), "a head of 12"),
], ids=["too long", "unknown table", "wrong width", "wrong length", "missing entry", "unaligned head"])
def test_bad_blocks_are_refused_from_their_header(block, match):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(block)
        with pytest.raises(ValueError, match=match):
            rows.read_request(b, DIMS, torch.float32)
