"""Sparse rows on the socket data plane: the bytes of a request's ``sparse`` block and of the
rows that come back (sparse embedding tables, docs/sparse.md).

A request with flag ``F_SPARSE`` carries, after its header and dense gradient bytes, a u64
length and a block:

    u32 tables; per table: u16 name length, u32 pushed ids, u32 wanted ids, u32 dim, the name,
    then the pushed ids (int64), their row gradients (pushed x dim, the wire dtype) and the
    wanted ids (int64)

and its reply carries, after the header and the dense parameters (none with shared memory), a
u64 length and the wanted rows of each table in the request's order (wanted x dim, the wire
dtype). Only the touched rows cross the wire: shared memory carries the dense buffers, the socket
these blocks. The server checks every length against its tables before reading a byte more than
the header promised (a block is at most ``MAX_BLOCK`` bytes).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from .protocol import DataPlaneError, recv_bytes, recv_exact, tensor_view

F_SPARSE = 8  # request flag: a sparse block follows the dense bytes
MAX_BLOCK = 1 << 31  # 2 GiB: far above any batch's rows; a larger length is refused unread
_LEN = struct.Struct("<Q")
_ENTRY = struct.Struct("<HIII")


def _bytes(t: torch.Tensor) -> memoryview | bytes:
    return tensor_view(t.contiguous()) if t.numel() else b""  # (numpy cannot view an empty tensor's bytes)


def encode(sparse: dict[str, tuple[Any, Any, Any]], wire: torch.dtype) -> list[memoryview | bytes]:
    """A request's sparse block (with its length) as buffers for ``sendall``."""
    head = [struct.pack("<I", len(sparse))]
    body: list[memoryview | bytes] = []
    for name, (ids, grads, want) in sparse.items():
        ids = ids if ids is not None else torch.empty(0, dtype=torch.int64)
        want = want if want is not None else torch.empty(0, dtype=torch.int64)
        dim = grads.shape[1] if grads is not None and grads.dim() == 2 else 0
        raw = name.encode()
        head.append(_ENTRY.pack(len(raw), len(ids), len(want), dim) + raw)
        body.append(_bytes(ids.to(torch.int64)))
        if len(ids):
            body.append(_bytes(grads.to(wire)))
        body.append(_bytes(want.to(torch.int64)))
    parts = [b"".join(head), *body]
    return [_LEN.pack(sum(len(p) for p in parts)), *parts]


def read_request(sock: Any, dims: dict[str, int], wire: torch.dtype) -> dict[str, tuple[Any, Any, Any]]:
    """Read a request's sparse block; ``dims``: this shard's tables and their widths. Raises
    ``ValueError`` (the caller answers with an error reply) for a length or table it cannot serve."""
    (length,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
    if length > MAX_BLOCK or length < 4:
        raise ValueError(f"a sparse block of {length} bytes (at most {MAX_BLOCK})")
    itemsize = torch.empty((), dtype=wire).element_size()
    (count,) = struct.unpack("<I", recv_bytes(sock, 4))
    used = 4
    entries = []
    for _ in range(count):
        if used + _ENTRY.size > length:
            raise ValueError("a sparse block shorter than its entries")
        name_len, n_push, n_want, dim = _ENTRY.unpack(recv_bytes(sock, _ENTRY.size))
        name = recv_bytes(sock, name_len).decode(errors="replace")
        used += _ENTRY.size + name_len
        if name not in dims:
            raise ValueError(f"no table {name!r} on this ps task (tables: {', '.join(dims) or 'none'})")
        if n_push and dim != dims[name]:
            raise ValueError(f"table {name!r} rows of width {dim}, the table's is {dims[name]}")
        used += n_push * 8 + n_push * dims[name] * itemsize + n_want * 8
        entries.append((name, n_push, n_want))
    if used != length:
        raise ValueError(f"a sparse block of {length} bytes whose entries need {used}")
    out = {}
    for name, n_push, n_want in entries:
        ids = torch.empty(n_push, dtype=torch.int64)
        _recv_into(sock, ids)
        grads = None
        if n_push:
            raw = torch.empty((n_push, dims[name]), dtype=wire)
            _recv_into(sock, raw)
            grads = raw.to(torch.float32)
        want = torch.empty(n_want, dtype=torch.int64)
        _recv_into(sock, want)
        out[name] = (ids, grads, want)
    return out


def _recv_into(sock: Any, t: torch.Tensor) -> None:
    if t.numel():
        recv_exact(sock, tensor_view(t))


def encode_rows(sparse: dict[str, tuple[Any, Any, Any]], rows: dict[str, torch.Tensor], dims: dict[str, int],
                wire: torch.dtype) -> list[memoryview | bytes]:
    """A reply's rows block, in the request's order (an empty block when the ps failed)."""
    parts = []
    for name in sparse:
        if name not in rows:
            return [_LEN.pack(0)]
        parts.append(_bytes(rows[name].to(wire)))
    return [_LEN.pack(sum(len(p) for p in parts)), *parts]


def read_rows(sock: Any, sparse: dict[str, tuple[Any, Any, Any]], dims: dict[str, int],
              wire: torch.dtype) -> dict[str, torch.Tensor]:
    """The rows block of a reply to a request that carried ``sparse``."""
    (length,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
    itemsize = torch.empty((), dtype=wire).element_size()
    sizes = {name: (len(want) if want is not None else 0) for name, (_i, _g, want) in sparse.items()}
    expected = sum(n * dims[name] * itemsize for name, n in sizes.items())
    if length == 0 and expected:
        return {}  # the ps stopped or failed: no rows
    if length != expected:
        raise DataPlaneError(f"a rows block of {length} bytes, expected {expected}")
    out = {}
    for name, n in sizes.items():
        raw = torch.empty((n, dims[name]), dtype=wire)
        _recv_into(sock, raw)
        out[name] = raw if wire == torch.float32 else raw.to(torch.float32)
    return out
