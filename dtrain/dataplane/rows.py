"""Sparse rows on the socket data plane: the bytes of a request's ``sparse`` block and of the
rows that come back (sparse embedding tables, docs/sparse.md).

A request's ``sparse`` argument maps a table name to (the ids whose row gradients it pushes,
those gradients, the ids whose rows it wants back); a :class:`SparseBlock` is the same entries
side by side, one tensor per kind, as the replica routes them and the ps batches them (a DLRM's
request names tens of tables: a tensor, a slice and a call per table cost the replica and the ps
more than the rows did).

A request with flag ``F_SPARSE`` carries, after its header and dense gradient bytes, a u64
length (of what follows) and a block:

    u32 tables, u32 head bytes; the head: per table u16 name length, u32 pushed ids, u32 wanted
    ids, u32 dim, the name (zero bytes up to a multiple of 8); then every table's pushed ids
    (int64), their row gradients (pushed x dim each, the wire dtype; zero bytes up to a multiple
    of 8) and every table's wanted ids (int64), each kind table after table

and its reply carries, after the header and the dense parameters (none with shared memory), a
u64 length and the wanted rows of each table in the request's order (wanted x dim, the wire
dtype). Only the touched rows cross the wire: shared memory carries the dense buffers, the socket
these blocks. Each side moves a block in one call, and reads it as views of one buffer. The
server checks the head against its tables before reading the body (a block is at most
``MAX_BLOCK`` bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .protocol import DataPlaneError, recv_bytes, recv_exact, tensor_view

F_SPARSE = 8  # request flag: a sparse block follows the dense bytes
MAX_BLOCK = 1 << 31  # 2 GiB: far above any batch's rows; a larger length is refused unread
_LEN = struct.Struct("<Q")
_ENTRY = struct.Struct("<HIII")
_HEAD = struct.Struct("<II")  # tables, head bytes


class SparseBlock(Mapping[str, tuple[Any, Any, Any]]):
    """One request's sparse entries side by side: the tables' ``names`` in request order, per table
    the number of ids it pushes (``push``) and wants (``want``) and its row width (``dims``); every
    table's pushed ids (``ids``, int64), their row gradients (``grads``: float, flat, each table's
    ``push x dim`` values in turn, or None without a push) and wanted ids (``wanted``, int64).

    As a mapping: name -> (ids, row gradients (push x dim), wanted ids), views, made on first use
    (the per-table paths: tables without a vocabulary, the actor transport's checks); the ps's
    batched path reads the flat tensors (``dtrain.ps.sparse.ShardTables``)."""

    __slots__ = ("names", "dims", "push", "want", "ids", "grads", "wanted", "_tables", "memo")

    def __init__(self, names: list[str], dims: list[int], push: list[int], want: list[int], ids: torch.Tensor,
                 grads: torch.Tensor | None, wanted: torch.Tensor):
        self.names, self.dims, self.push, self.want = names, dims, push, want
        self.ids, self.grads, self.wanted = ids, grads, wanted
        self._tables: dict[str, tuple[Any, Any, Any]] | None = None
        # what a receiver derives from the block once and reads in several passes (the ps: each
        # id's member of its table group and its row there, for the check, the add and the gather)
        self.memo: dict[Any, Any] = {}

    @classmethod
    def of(cls, sparse: Mapping[str, tuple[Any, Any, Any]]) -> SparseBlock:
        """The block of a per-table mapping (a pushed table without row gradients has width 0)."""
        if isinstance(sparse, SparseBlock):
            return sparse
        names, dims, push, want, ids, grads, wanted = [], [], [], [], [], [], []
        for name, (i, g, w) in sparse.items():
            n_push = 0 if i is None else int(i.shape[0])
            names.append(name)
            dims.append(int(g.shape[1]) if g is not None and g.dim() == 2 else 0)
            push.append(n_push)
            want.append(0 if w is None else int(w.shape[0]))
            if n_push:
                ids.append(i.to(torch.int64))
                grads.append(g.reshape(-1))
            if w is not None and len(w):
                wanted.append(w.to(torch.int64))
        empty = torch.empty(0, dtype=torch.int64)
        return cls(names, dims, push, want, torch.cat(ids) if ids else empty,
                   torch.cat(grads) if grads else None, torch.cat(wanted) if wanted else empty)

    @property
    def width(self) -> int | None:
        """The one row width of every table that pushes, or None when they differ (or none push)."""
        widths = {d for d, n in zip(self.dims, self.push, strict=True) if n}
        return widths.pop() if len(widths) == 1 else None

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.wanted.nbytes + (self.grads.nbytes if self.grads is not None else 0))

    def _per_table(self) -> dict[str, tuple[Any, Any, Any]]:
        if self._tables is None:
            ids = self.ids.split(self.push)
            wanted = self.wanted.split(self.want)
            sizes = [n * d for n, d in zip(self.push, self.dims, strict=True)]
            grads = self.grads.split(sizes) if self.grads is not None else None
            self._tables = {
                name: (ids[t], grads[t].view(self.push[t], self.dims[t]) if grads is not None else None, wanted[t])
                for t, name in enumerate(self.names)}
        return self._tables

    def __getitem__(self, name: str) -> tuple[Any, Any, Any]:
        return self._per_table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __reduce__(self) -> tuple[Any, ...]:  # (the actor transport pickles it; the views are remade)
        return (SparseBlock, (self.names, self.dims, self.push, self.want, self.ids, self.grads, self.wanted))


def _bytes(t: torch.Tensor) -> memoryview | bytes:
    return tensor_view(t.contiguous()) if t.numel() else b""  # (numpy cannot view an empty tensor's bytes)


def _pad(n: int) -> int:
    return -n % 8


def encode(sparse: Mapping[str, tuple[Any, Any, Any]], wire: torch.dtype) -> list[memoryview | bytes]:
    """A request's sparse block, its length first, as buffers to join (``b"".join``) and send at once."""
    block = SparseBlock.of(sparse)
    head = b"".join(_ENTRY.pack(len(raw := name.encode()), n, w, d) + raw
                    for name, n, w, d in zip(block.names, block.push, block.want, block.dims, strict=True))
    head += bytes(_pad(len(head)))
    body: list[memoryview | bytes] = [_bytes(block.ids)]
    if block.grads is not None:
        grads = _bytes(block.grads.to(wire))
        body += [grads, bytes(_pad(len(grads)))]
    body.append(_bytes(block.wanted))
    size = _HEAD.size + len(head) + sum(len(b) for b in body)
    return [_LEN.pack(size), _HEAD.pack(len(block.names), len(head)), head, *body]


def read_request(sock: Any, dims: dict[str, int], wire: torch.dtype) -> SparseBlock:
    """Read a request's sparse block (views of one buffer); ``dims``: this shard's tables and their widths. Raises
    ``ValueError`` (the caller answers with an error reply) for a length or table it cannot serve,
    from the head alone (the body is read only when the head adds up to the block's length)."""
    length, count, head_len = struct.unpack("<QII", recv_bytes(sock, _LEN.size + _HEAD.size))
    if length > MAX_BLOCK or length < _HEAD.size + head_len or head_len % 8:
        raise ValueError(f"a sparse block of {length} bytes with a head of {head_len} (at most {MAX_BLOCK} bytes)")
    itemsize = torch.empty((), dtype=wire).element_size()
    head = recv_bytes(sock, head_len)
    at, used, grad_bytes = 0, _HEAD.size + head_len, 0
    entries = []
    for _ in range(count):
        if at + _ENTRY.size > head_len:
            raise ValueError("a sparse block's head shorter than its entries")
        name_len, n_push, n_want, dim = _ENTRY.unpack_from(head, at)
        name = head[at + _ENTRY.size:at + _ENTRY.size + name_len].decode(errors="replace")
        at += _ENTRY.size + name_len
        if name not in dims:
            raise ValueError(f"no table {name!r} on this ps task (tables: {', '.join(dims) or 'none'})")
        if n_push and dim != dims[name]:
            raise ValueError(f"table {name!r} rows of width {dim}, the table's is {dims[name]}")
        grad_bytes += n_push * dims[name] * itemsize
        used += n_push * 8 + n_push * dims[name] * itemsize + n_want * 8
        entries.append((name, n_push, n_want))
    used += _pad(grad_bytes)
    if at > head_len or head_len - at >= 8 or used != length:
        raise ValueError(f"a sparse block of {length} bytes whose entries need {used}")
    body = torch.empty(length - _HEAD.size - head_len, dtype=torch.uint8)
    if body.numel():
        recv_exact(sock, tensor_view(body))
    names = [e[0] for e in entries]
    push = [e[1] for e in entries]
    want = [e[2] for e in entries]
    pushed = sum(push)
    ids = body[:pushed * 8].view(torch.int64)
    grads = None
    at = pushed * 8
    if pushed:
        grads = body[at:at + grad_bytes].view(wire).to(torch.float32)
        at += grad_bytes + _pad(grad_bytes)
    wanted = body[at:at + sum(want) * 8].view(torch.int64)
    return SparseBlock(names, [dims[n] for n in names], push, want, ids, grads, wanted)


def encode_rows(sparse: Mapping[str, tuple[Any, Any, Any]], rows: dict[str, torch.Tensor] | torch.Tensor,
                dims: dict[str, int], wire: torch.dtype) -> list[memoryview | bytes]:
    """A reply's rows block, in the request's order, as buffers to join and send at once. ``rows``:
    per table, or every wanted row side by side in the request's order (the ps's batched path);
    an empty dict when the ps failed (an empty block)."""
    if isinstance(rows, torch.Tensor):
        raw = _bytes(rows.to(wire))
        return [_LEN.pack(len(raw)), raw]
    parts = []
    for name in sparse:
        if name not in rows:
            return [_LEN.pack(0)]
        parts.append(_bytes(rows[name].to(wire)))
    return [_LEN.pack(sum(len(p) for p in parts)), *parts]


def read_rows(sock: Any, sparse: Mapping[str, tuple[Any, Any, Any]], dims: dict[str, int],
              wire: torch.dtype) -> dict[str, torch.Tensor] | torch.Tensor:
    """The rows block of a reply to a request that carried ``sparse``, in one read: every wanted
    row side by side in the request's order (float32, a view of the block on a float32 wire) when
    the wanted tables share one width, else per table; ``{}`` when the ps stopped or failed."""
    (length,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
    itemsize = torch.empty((), dtype=wire).element_size()
    block = SparseBlock.of(sparse)
    widths = [dims[name] for name in block.names]
    total = sum(n * d for n, d in zip(block.want, widths, strict=True))
    expected = total * itemsize
    if length == 0 and expected:
        return {}  # the ps stopped or failed: no rows
    if length != expected:
        raise DataPlaneError(f"a rows block of {length} bytes, expected {expected}")
    raw = torch.empty(total, dtype=wire)
    if length:
        recv_exact(sock, tensor_view(raw))
    flat = raw if wire == torch.float32 else raw.to(torch.float32)
    wanted = {d for d, n in zip(widths, block.want, strict=True) if n}
    if len(wanted) <= 1:
        return flat.view(-1, wanted.pop() if wanted else max(widths, default=1))
    out = {}
    at = 0
    for name, n, d in zip(block.names, block.want, widths, strict=True):
        out[name] = flat[at:at + n * d].view(n, d)
        at += n * d
    return out
