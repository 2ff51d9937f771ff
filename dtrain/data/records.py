"""Recommendation records from parquet: a :class:`~dtrain.data.features.RecordLayout`'s columns
read from a table and packed into int64 rows.

Column types a layout accepts:

- a dense column: any numeric type, read as float32 as stored (no transform: Criteo's
  ``log(1 + x)`` is the TSV reader's, whose counts are raw); a null, NaN or infinity is an error;
- a categorical column: integers (one id per example), ``list<integer>`` (multi-hot), strings or
  ``list<string>`` (each string's id is :func:`~dtrain.data.features.hash64` of it). A null value
  (or a null list) is one :data:`~dtrain.data.features.MISSING_ID`; an empty list is an empty
  bag; a null inside a list is ``MISSING_ID``;
- a weighted categorical column's weights: the sibling column ``<name>_weights``, float (for
  single ids) or ``list<float>`` with one weight per id (a null row where the ids are null: 1.0).

Errors name the file, the row (0-based, counted from the file's first row) and the column.
Pure numpy and pyarrow.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .errors import BadRecordError, ShardError
from .features import MAX_ID, MISSING_ID, LayoutError, RecordLayout, hash64

_LIST = re.compile(r"^(?:large_)?list<[^:]*: (.+)>$")
_FLOATS = ("float", "double", "halffloat")


def _integer(t: str) -> bool:
    return t.startswith(("int", "uint"))


def _kind(t: str) -> str | None:
    """'int', 'str', 'list<int>' or 'list<str>' for a usable categorical type, else None."""
    inner = _LIST.match(t)
    base = inner.group(1) if inner else t
    kind = "int" if _integer(base) else "str" if base in ("string", "large_string") else None
    return None if kind is None else f"list<{kind}>" if inner else kind


def weights_column(name: str) -> str:
    """The column holding a weighted categorical column's weights."""
    return f"{name}_weights"


def check_columns(path: str, columns: dict[str, str], layout: RecordLayout) -> None:
    """ShardError naming the file and the column when ``columns`` (name -> arrow type) cannot feed
    ``layout``."""
    problems = []
    for name in layout.dense:
        t = columns.get(name)
        if t is None:
            problems.append(f"dense column {name!r} is missing")
        elif not (_integer(t) or t in (*_FLOATS, "bool")):
            problems.append(f"dense column {name!r} is {t}, not numeric")
    for col in layout.categorical:
        t = columns.get(col.name)
        if t is None:
            problems.append(f"categorical column {col.name!r} is missing")
            continue
        kind = _kind(t)
        if kind is None:
            problems.append(f"categorical column {col.name!r} is {t}: use integer ids, list<int64> (multi-hot) or "
                            "strings (hashed)")
        if col.weighted and kind is not None:
            w = columns.get(weights_column(col.name))
            inner = _LIST.match(w or "")
            if w is None:
                problems.append(f"weighted column {col.name!r} needs its weights in a column "
                                f"{weights_column(col.name)!r}")
            elif (inner.group(1) if inner else w) not in _FLOATS or bool(inner) != kind.startswith("list"):
                want = "list<float>" if kind.startswith("list") else "float"
                problems.append(f"weights column {weights_column(col.name)!r} is {w}: {col.name!r} is {t}, so its "
                                f"weights are {want}")
    if problems:
        raise ShardError(f"{path}: {'; '.join(problems)} (model.features names the columns to read)")


def _csr(arr: Any, where: Any, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values int64, lengths, null rows) of a categorical column (a combined pyarrow array), before
    null rows get their MISSING_ID."""
    import pyarrow as pa

    flat, lengths, null = _flatten(arr)
    if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
        codes = flat.dictionary_encode()
        hashed = hash64(codes.dictionary.to_numpy(zero_copy_only=False))
        idx = np.asarray(codes.indices.fill_null(-1), dtype=np.int64)
        values = np.where(idx >= 0, hashed[np.maximum(idx, 0)] if len(hashed) else MISSING_ID, MISSING_ID)
    else:
        values = np.asarray(flat.fill_null(MISSING_ID).to_numpy(zero_copy_only=False))
        if values.dtype.kind == "u" and values.size and values.max() > MAX_ID:
            first = int(np.argmax(values > MAX_ID))
            row = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
            raise where(row, name, f"id {int(values[first])} is above 2**63 - 1")
        values = values.astype(np.int64, copy=False)
    return values, lengths, null


def _fill_missing(values: np.ndarray, lengths: np.ndarray, null: np.ndarray, fill: Any
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Give each null row one ``fill`` value (CSR in, CSR out)."""
    if not null.any():
        return values, lengths
    out_len = np.where(null, 1, lengths)
    out = np.full(int(out_len.sum()), fill, dtype=values.dtype)
    keep = np.repeat(~null, out_len)
    out[keep] = values
    return out, out_len


def read_records(table: Any, layout: RecordLayout, path: str, first_row: int = 0) -> np.ndarray:
    """The table's rows packed by ``layout`` (int64 (N, width)); BadRecordError naming the file,
    the row (``first_row`` + index) and the column on a bad value."""

    def where(row: int, column: str, reason: str) -> BadRecordError:
        return BadRecordError(f"{path}: row {first_row + row}: {column}: {reason}")

    n = table.num_rows
    dense = np.empty((n, len(layout.dense)), dtype=np.float32)
    for j, name in enumerate(layout.dense):
        col = table.column(name)
        if col.null_count:
            raise where(int(np.argmax(np.asarray(col.is_null()))), name, "missing (a dense value is a number)")
        dense[:, j] = col.to_numpy()
        if not np.isfinite(dense[:, j]).all():
            row = int(np.argmax(~np.isfinite(dense[:, j])))
            raise where(row, name, f"{dense[row, j]} (dense values must be finite)")
    ids, weights = [], []
    for col in layout.categorical:
        arr = table.column(col.name).combine_chunks()
        values, lengths, null = _csr(arr, where, col.name)
        w = None
        if col.weighted:
            warr = table.column(weights_column(col.name)).combine_chunks()
            wvalues, wlengths, wnull = _csr_weights(warr)
            if (bad := np.flatnonzero((wlengths != lengths) | (wnull & ~null))).size:
                r = int(bad[0])
                raise where(r, weights_column(col.name), f"{int(wlengths[r])} weight(s) for {int(lengths[r])} id(s) "
                                                         f"in {col.name!r} (one weight per id)")
            if np.isnan(wvalues).any():
                first = int(np.argmax(np.isnan(wvalues)))
                raise where(int(np.searchsorted(np.cumsum(lengths), first, side="right")), weights_column(col.name),
                            "a missing weight")
            w, _ = _fill_missing(wvalues, wlengths, null, 1.0)
        values, lengths = _fill_missing(values, lengths, null, MISSING_ID)
        ids.append((values, lengths))
        weights.append(w)
    try:
        return layout.pack(dense, ids, weights)
    except LayoutError as exc:
        if exc.row is None:
            raise BadRecordError(f"{path}: {exc}") from None
        raise where(exc.row, exc.column, exc.reason) from None


def _csr_weights(arr: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights float32 (NaN for a null weight), lengths, null rows) of a weights column."""
    import pyarrow as pa

    flat, lengths, null = _flatten(arr)
    return np.asarray(flat.cast(pa.float32()).to_numpy(zero_copy_only=False), dtype=np.float32), lengths, null


def _flatten(arr: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """(the values side by side, each row's count, the null rows) of a list or a scalar column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    null = np.asarray(arr.is_null())
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return arr.flatten(), np.asarray(pc.list_value_length(arr).fill_null(0), dtype=np.int64), null
    return arr.drop_null(), (~null).astype(np.int64), null
