"""Recommendation records packed into one fixed-width int64 row: the codec.

A recommendation example has a few dense features (floats) and tens of categorical features, each
a list of 64-bit ids (one id: *single-id*; several: *multi-hot*), optionally with one float weight
per id. The data path (shards, the stream, the shuffle window, batches, resumable positions,
in-memory index_select) moves a batch as one 2-D ``x``, so a :class:`RecordLayout` packs every
example into a row of ``layout.width`` int64 values:

- the dense values, in ``layout.dense`` order, as float32 bit patterns (float32 -> int32 bits ->
  int64, sign-extended);
- for each categorical column, in ``layout.categorical`` order, ``max_ids`` id slots: the
  example's ids, then :data:`PAD` (-1) up to ``max_ids``; valid ids are ``0 .. 2**63 - 1``;
- for each *weighted* categorical column, in the same order, ``max_ids`` weight slots (float32
  bits as for dense; 0.0 after the example's weights).

:meth:`RecordLayout.unpack` turns a batch back into what ``torch.nn.EmbeddingBag`` takes per
column: flat ``ids``, ``offsets`` (the start of each example's ids) and ``per_sample_weights``
(``include_last_offset=False``), vectorised over the batch, on the batch's device.

Conventions shared by every reader: a missing categorical value is the id :data:`MISSING_ID`
(as MLPerf's Criteo preprocessing maps an empty field to 0); a string id is :func:`hash64` of
it; a dense value goes through :func:`dense_transform` (``log(1 + max(x, 0))``, missing -> 0).
Pure numpy and torch (torch only to unpack).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by unpack: the readers (and the manifest) never need it
    import torch

MISSING_ID = 0
"""The id a missing (empty) categorical value reads as (MLPerf's Criteo preprocessing maps '' to 0)."""

PAD = -1
"""An unused id slot. Valid ids are non-negative int64 (0 .. 2**63 - 1)."""

MAX_ID = 2**63 - 1


class LayoutError(ValueError):
    """A record that does not fit its layout: names the column and the first offending row (0-based)."""

    def __init__(self, column: str, row: int | None, reason: str):
        self.column, self.row, self.reason = column, row, reason
        super().__init__(f"{column}: " + (f"row {row}: " if row is not None else "") + reason)


@dataclass(frozen=True)
class CategoricalColumn:
    """One categorical feature: its column name, the most ids an example may hold, and whether each
    id carries a float32 weight (``per_sample_weights``)."""

    name: str
    max_ids: int = 1
    weighted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a categorical column needs a name, got {self.name!r}")
        if isinstance(self.max_ids, bool) or not isinstance(self.max_ids, int) or self.max_ids < 1:
            raise ValueError(f"{self.name}: max_ids must be an integer >= 1 (1 = single-id), got {self.max_ids!r}")


@dataclass
class Records:
    """A batch unpacked: ``dense`` float32 (B, len(layout.dense)); per categorical column name
    ``(ids int64 flat, offsets int64 (B,), weights float32 flat or None)``, exactly
    ``nn.EmbeddingBag(ids, offsets, per_sample_weights=weights)`` (include_last_offset=False)."""

    dense: torch.Tensor
    features: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _bits32(values: np.ndarray) -> np.ndarray:
    """float32 values' int32 bit patterns (a view when already float32; copied into int64 slots,
    sign-extended)."""
    return np.ascontiguousarray(values, dtype=np.float32).view(np.int32)


def _floats(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits).astype(np.int32).view(np.float32)  # astype keeps the low 32 bits


_BAND_BYTES = 1 << 20
"""How much of its output (in bytes, whole rows) pack fills at a time: a band stays in cache while
every column is copied into it, where copying each column over the whole output would bring every
row's cache lines in again for each column."""


def _checked(col: CategoricalColumn, n: int, values: np.ndarray, lengths: np.ndarray,
             w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
    """One column's pack input checked: (values int64, lengths int64, weights float32 or None,
    whether every list is full). LayoutError as :meth:`RecordLayout.pack` says. Each check is a
    whole-array reduction; the first offending row is looked for only once there is one."""
    m = col.max_ids
    values = np.asarray(values)
    lengths = np.asarray(lengths)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise LayoutError(col.name, None, f"ids must be a flat integer array, got {values.dtype} {values.shape}")
    if lengths.shape != (n,) or (lengths.size and lengths.dtype.kind not in "iu"):
        raise LayoutError(col.name, None, f"lengths must be {n} integers (one per example), got "
                                          f"{lengths.dtype} {lengths.shape}")
    lengths = lengths.astype(np.int64, copy=False)
    low, high = (int(lengths.min()), int(lengths.max())) if n else (m, m)
    if low < 0 or high > m:
        r = int(np.flatnonzero((lengths > m) | (lengths < 0))[0])
        raise LayoutError(col.name, r, f"{int(lengths[r])} ids, more than the column's max_ids {m}"
                          if lengths[r] > m else f"negative length {int(lengths[r])}")
    if (total := int(lengths.sum())) != len(values):
        raise LayoutError(col.name, None, f"lengths add up to {total}, but {len(values)} ids were given")
    if values.dtype.kind == "u" and values.size and values.max() > MAX_ID:
        first = int(np.argmax(values > MAX_ID))
        raise LayoutError(col.name, int(np.searchsorted(np.cumsum(lengths), first, side="right")),
                          f"id {int(values[first])} is above 2**63 - 1")
    values = values.astype(np.int64, copy=False)
    if values.size and values.min() < 0:
        first = int(np.flatnonzero(values < 0)[0])
        raise LayoutError(col.name, int(np.searchsorted(np.cumsum(lengths), first, side="right")),
                          f"id {int(values[first])} is negative (ids are 0 .. 2**63 - 1)")
    if col.weighted:
        if w is None:
            raise LayoutError(col.name, None, "the column is weighted: give its weights")
        w = np.asarray(w, dtype=np.float32)
        if w.shape != values.shape:
            raise LayoutError(col.name, None, f"{len(values)} ids but weights of shape {w.shape}")
    elif w is not None:
        raise LayoutError(col.name, None, "weights given for a column that is not weighted (set weighted=True)")
    return values, lengths, w, low == m


def _padded(values: np.ndarray, lengths: np.ndarray, m: int, fill: int) -> np.ndarray:
    """(N, m) rows of ``values``'s lists (CSR by ``lengths``, each at most m long), each followed
    by ``fill``. A boolean mask's True slots, in row-major order, are the lists' slots in CSR order,
    so one masked assignment places them (an (N, m) bool temporary, no per-id index arrays)."""
    block = np.full((len(lengths), m), fill, dtype=values.dtype)
    block[np.arange(m) < lengths[:, None]] = values
    return block


@dataclass(frozen=True)
class RecordLayout:
    """Which columns an example holds and where each sits in the packed int64 row (module docstring)."""

    dense: tuple[str, ...]
    categorical: tuple[CategoricalColumn, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense", tuple(self.dense))  # lists accepted; the layout stays hashable
        object.__setattr__(self, "categorical", tuple(self.categorical))
        names = [*self.dense, *(c.name for c in self.categorical)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"a record layout names each column once; repeated: {', '.join(dup)}")
        if not names:
            raise ValueError("a record layout needs at least one dense or categorical column")
        if any(not isinstance(n, str) or not n for n in self.dense):
            raise ValueError(f"dense column names must be non-empty strings, got {list(self.dense)}")

    # ------------------------------------------------------------------ geometry
    @property
    def width(self) -> int:
        """int64 values per packed row."""
        return len(self.dense) + sum(c.max_ids for c in self.categorical) + \
            sum(c.max_ids for c in self.categorical if c.weighted)

    @property
    def names(self) -> tuple[str, ...]:
        """Every column the layout reads: the dense ones, then the categorical ones."""
        return (*self.dense, *(c.name for c in self.categorical))

    def slots(self) -> dict[str, tuple[int, int, int | None]]:
        """Per categorical column: (first id slot, max_ids, first weight slot or None)."""
        out: dict[str, tuple[int, int, int | None]] = {}
        at = len(self.dense)
        wat = at + sum(c.max_ids for c in self.categorical)
        for c in self.categorical:
            out[c.name] = (at, c.max_ids, wat if c.weighted else None)
            at += c.max_ids
            wat += c.max_ids if c.weighted else 0
        return out

    # ------------------------------------------------------------------ packing
    def pack(self, dense: np.ndarray, ids: Sequence[tuple[np.ndarray, np.ndarray]],
             weights: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
        """int64 (N, width) rows from ``dense`` float32 (N, len(dense)) and, per categorical column,
        ``ids[i] = (values int64 flat, lengths (N,))`` (the example's ids, CSR by lengths) and
        ``weights[i]`` float32 flat aligned with the values (required iff the column is weighted).
        :class:`LayoutError` (a ValueError) naming the column and the first offending row when a
        list is longer than ``max_ids`` or an id is negative.

        Every column is checked first (whole-array reductions; the offending row is looked for only
        once one is known to exist), then made an (N, max_ids) block (a reshape when every list is
        full, as single-id columns are), then the blocks are copied into the rows a cache-sized
        band at a time: one pass over the output, not one per column."""
        cats = self.categorical
        dense = np.asarray(dense)
        if dense.ndim == 1 and not self.dense:
            dense = dense.reshape(-1, 0)
        if dense.ndim != 2 or dense.shape[1] != len(self.dense):
            raise ValueError(f"dense values must be (N, {len(self.dense)}) for columns {list(self.dense)}, "
                             f"got shape {dense.shape}")
        if len(ids) != len(cats):
            raise ValueError(f"pack needs one (values, lengths) pair per categorical column ({len(cats)}: "
                             f"{', '.join(c.name for c in cats)}), got {len(ids)}")
        weights = [None] * len(cats) if weights is None else list(weights)
        if len(weights) != len(cats):
            raise ValueError(f"weights: one entry (or None) per categorical column ({len(cats)}), got {len(weights)}")
        n = len(dense)
        blocks = [(0, _bits32(dense))]  # (first slot, (N, k) int64 or int32 block); int32 sign-extends
        slots = self.slots()
        for col, (values, lengths), w in zip(cats, ids, weights, strict=True):
            at, m, wat = slots[col.name]
            values, lengths, w, full = _checked(col, n, values, lengths, w)
            blocks.append((at, values.reshape(n, m) if full else _padded(values, lengths, m, PAD)))
            if wat is not None:
                assert w is not None  # (a weighted column: checked)
                bits = _bits32(w)
                blocks.append((wat, bits.reshape(n, m) if full else _padded(bits, lengths, m, 0)))
        out = np.empty((n, self.width), dtype=np.int64)
        band = max(1, _BAND_BYTES // (8 * self.width))
        for start in range(0, n, band):
            rows = out[start:start + band]
            for at, block in blocks:
                rows[:, at:at + block.shape[1]] = block[start:start + band]
        return out

    # ------------------------------------------------------------------ unpacking
    def unpack(self, x: torch.Tensor) -> Records:
        """A batch of packed rows (int64 (B, width), any device) as :class:`Records`, vectorised over
        the rows (two host synchronisations in all: the mask's nonzero and the per-column counts)."""
        import torch

        if x.dim() != 2 or x.shape[1] != self.width or x.dtype != torch.int64:
            raise ValueError(f"packed records are int64 (B, {self.width}) for this layout, got {x.dtype} "
                             f"{tuple(x.shape)}")
        b, d = x.shape[0], len(self.dense)
        dense = x[:, :d].to(torch.int32).view(torch.float32)
        cats = self.categorical
        if not cats:
            return Records(dense, {})
        # Column by column, each column's slots row-major: the ids of column c, in row order, are a
        # contiguous run of ``flat``, so one mask and one nonzero serve every column. Neighbouring
        # columns of one max_ids (and weightedness) are one (B, columns, max_ids) block of x: a block
        # is copied (and its lengths counted) in one op, not one per column (Criteo's 26 columns: 2).
        blocks: list[list[int]] = []  # [first id slot, columns, max_ids, first weight slot or -1]
        for a, m, wa in self.slots().values():
            if blocks and blocks[-1][2] == m and (blocks[-1][3] < 0) == (wa is None):
                blocks[-1][1] += 1
            else:
                blocks.append([a, 1, m, -1 if wa is None else wa])
        flat = x.new_empty(b * sum(c.max_ids for c in cats))
        weighted = any(c.weighted for c in cats)
        wflat = x.new_zeros(len(flat)) if weighted else flat
        start = 0
        for a, k, m, wa in blocks:
            flat[start:start + b * k * m].view(k, b, m).copy_(x[:, a:a + k * m].reshape(b, k, m).transpose(0, 1))
            if wa >= 0:
                wflat[start:start + b * k * m].view(k, b, m).copy_(x[:, wa:wa + k * m].reshape(b, k, m).transpose(0, 1))
            start += b * k * m
        mask = flat >= 0  # PAD and nothing else is negative (pack refuses negative ids)
        where = mask.nonzero().squeeze(1)
        ids_all = flat.index_select(0, where)
        if weighted:
            w_all = wflat.index_select(0, where).to(torch.int32).view(torch.float32)
        counts = []
        start = 0
        for _a, k, m, _wa in blocks:  # per-example counts, per column (no sync)
            counts.append(mask[start:start + b * k * m].view(k, b, m).sum(2))
            start += b * k * m
        lengths = torch.cat(counts)  # (C, B)
        totals = lengths.sum(1).tolist()
        offsets = torch.cumsum(lengths, 1) - lengths
        ids = torch.split(ids_all, totals)
        ws = torch.split(w_all, totals) if weighted else [None] * len(cats)
        features = {c.name: (ids[i], offsets[i], ws[i] if c.weighted else None) for i, c in enumerate(cats)}
        return Records(dense, features)

    def unpack_numpy(self, x: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]],
                                                    list[np.ndarray | None]]:
        """The inverse of :meth:`pack`: ``(dense, ids, weights)`` such that ``pack(*unpack_numpy(x))``
        equals ``x`` (for evaluation and tests)."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.width or x.dtype != np.int64:
            raise ValueError(f"packed records are int64 (N, {self.width}) for this layout, got {x.dtype} {x.shape}")
        dense = _floats(x[:, :len(self.dense)])
        ids: list[tuple[np.ndarray, np.ndarray]] = []
        weights: list[np.ndarray | None] = []
        for _name, (a, m, wa) in self.slots().items():
            block = x[:, a:a + m]
            mask = block >= 0
            ids.append((block[mask], mask.sum(1).astype(np.int64)))
            weights.append(_floats(x[:, wa:wa + m])[mask] if wa is not None else None)
        return dense, ids, weights


def hash64(strings: Iterable[str] | np.ndarray) -> np.ndarray:
    """Stable 64-bit ids for strings: blake2b (digest_size=8) of each string's UTF-8 bytes, read
    little-endian, masked to non-negative (``& (2**63 - 1)``). The same string gives the same id
    on every machine and in every run (unlike Python's ``hash``). Each distinct string is hashed
    once. A numpy bytes array (dtype ``S``) is hashed as its bytes."""
    values = (strings if isinstance(strings, np.ndarray) else np.asarray(list(strings), dtype=object)).reshape(-1)
    if not len(values):
        return np.empty(0, dtype=np.int64)
    if values.dtype.kind not in "US":  # (str objects: numpy's own strings sort and compare faster)
        if not all(isinstance(v, str) for v in values):
            bad = next(v for v in values if not isinstance(v, str))
            raise TypeError(f"hash64 hashes strings, got {type(bad).__name__} {bad!r}")
        values = values.astype(str)
    uniq, inverse = np.unique(values, return_inverse=True)
    raw = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in uniq.tolist()]  # 'S': the bytes
    digests = b"".join(hashlib.blake2b(b, digest_size=8).digest() for b in raw)
    hashed = np.frombuffer(digests, dtype="<u8") & np.uint64(MAX_ID)
    return hashed.astype(np.int64)[inverse.reshape(-1)]


def dense_transform(values: np.ndarray | Sequence[float]) -> np.ndarray:
    """The dense features' transform: ``log(1 + max(x, 0))`` as float32, a missing value (NaN) -> 0
    (what DLRM applies to Criteo's integer counts)."""
    x = np.asarray(values, dtype=np.float64)
    return np.log1p(np.maximum(np.where(np.isnan(x), 0.0, x), 0.0)).astype(np.float32)
