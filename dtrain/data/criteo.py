"""Criteo-layout TSV files: reading them into packed recommendation records.

The layout (Criteo's Kaggle and 1TB click logs): one example per line, no header, 40 fields
separated by tabs: ``label`` (0 or 1), 13 integer features ``I1``..``I13`` (counts; may be
negative, may be empty) and 26 categorical features ``C1``..``C26`` (hashed values written as
8 hexadecimal digits such as ``68fd1e64``; may be empty). Files are ``.tsv`` or ``.tsv.gz``.

How a field becomes a value (only the columns a :class:`~dtrain.data.features.RecordLayout`
names are decoded):

- an integer feature: :func:`~dtrain.data.features.dense_transform` of it (``log(1 + max(x, 0))``,
  empty -> 0);
- a categorical feature: the id the hex digits spell (1 to 16 digits, either case; at most
  ``2**63 - 1``); empty -> :data:`~dtrain.data.features.MISSING_ID`. Several ids separated by
  commas (``68fd1e64,2c16a946``) are a multi-hot list, at most the column's ``max_ids`` of them;
  a weighted column reads weight 1.0 for every id (a TSV carries no weights).

A bad line (the wrong number of fields, a non-integer count, a non-hex id, a list longer than
``max_ids``, a label other than 0/1) raises :class:`CriteoError` naming the file, the line
(1-based) and the field: ``day_0.tsv.gz:1234: C7: 'zz12' is not a hexadecimal id``. Parsing is
pyarrow's CSV reader and vectorised numpy: no Python loop over lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadRecordError
from .features import MISSING_ID, CategoricalColumn, RecordLayout, dense_transform
from .sources import CRITEO_SUFFIXES  # noqa: F401 - re-exported: the format's file names

CRITEO_DENSE: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
CRITEO_COLUMNS: tuple[str, ...] = ("label", *CRITEO_DENSE, *CRITEO_CATEGORICAL)
"""The 40 fields of a Criteo line, in order."""

CRITEO_1TB_CARDINALITIES: tuple[int, ...] = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208, 11938, 155, 4,
    976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)
"""Distinct values of C1..C26 in Criteo 1TB (the MLPerf DLRM reference's embedding table sizes)."""

_LUT = np.full(256, 255, dtype=np.uint8)  # ASCII byte -> hex digit value (255: not one)
_LUT[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_LUT[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_LUT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _pair_table() -> np.ndarray:
    """Two ASCII hex digits read as one little-endian uint16 -> the byte they spell (0xFFFF: not hex)."""
    codes = np.arange(1 << 16)
    first, second = _LUT[codes & 0xFF], _LUT[codes >> 8]
    ok = (first != 255) & (second != 255)
    table = np.full(1 << 16, 0xFFFF, dtype=np.uint16)
    table[ok] = (first[ok].astype(np.uint16) << 4) | second[ok]
    return table


_PAIR = _pair_table()
_COMMA = ord(",")
_MISSING_DIGITS = np.frombuffer(f"{MISSING_ID:08x}".encode(), np.uint8)
"""An empty field's id as 8 hex digits: what :func:`_eight_digit_lists` reads for it."""
_INTEGER = re.compile(r"^[+-]?[0-9]{1,18}$")


class CriteoError(BadRecordError):
    """A Criteo file that cannot be read as the layout says: names the file, the line and the field.
    A :class:`~dtrain.data.shards.BadShardError` (so ``data.skip_bad_files`` can skip the file
    mid-run) and a ValueError."""


def criteo_layout(dense: tuple[str, ...] = CRITEO_DENSE, categorical: tuple[str, ...] = CRITEO_CATEGORICAL,
                  max_ids: dict[str, int] | None = None, weighted: tuple[str, ...] = ()) -> RecordLayout:
    """A layout of Criteo columns: every dense and categorical one by default; ``max_ids`` per
    multi-hot column (others single-id)."""
    max_ids = max_ids or {}
    return RecordLayout(tuple(dense), tuple(CategoricalColumn(c, max_ids.get(c, 1), c in weighted)
                                            for c in categorical))


def check_layout(layout: RecordLayout, where: str) -> None:
    """ValueError when ``layout`` names a column Criteo data does not have (dense: I1..I13,
    categorical: C1..C26)."""
    bad = [n for n in layout.dense if n not in CRITEO_DENSE] + \
        [c.name for c in layout.categorical if c.name not in CRITEO_CATEGORICAL]
    if bad:
        raise ValueError(f"{where}: Criteo-layout data has no {'/'.join(bad)} column here: its dense features are "
                         "I1..I13 and its categorical features C1..C26 (the label is 'label')")


@contextmanager
def _stream(path: str) -> Iterator[Any]:
    """A pyarrow input stream of the file's text (decompressed for ``.gz``); local files natively."""
    import pyarrow as pa

    gz = path.lower().endswith(".gz")
    if "://" not in path or path.startswith("file://"):
        with pa.input_stream(path.removeprefix("file://"), compression="gzip" if gz else None) as s:
            yield s
        return
    import fsspec

    with fsspec.open(path, "rb") as f:
        raw = pa.PythonFile(f, mode="r")
        with (pa.CompressedInputStream(raw, "gzip") if gz else raw) as s:
            yield s


def count_lines(path: str) -> int:
    """Lines in a Criteo file (a last line without a newline counts), streaming (gzip decompressed
    on the fly, bounded memory). CriteoError when its first line does not have 40 fields."""
    lines, last, first = 0, b"\n", None
    try:
        with _stream(path) as s:
            while chunk := s.read(1 << 22):
                if first is None:
                    first = chunk.split(b"\n", 1)[0]
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError as exc:
        raise CriteoError(f"{path}: cannot be read: {' '.join(str(exc).split())}") from exc
    fields = None if first is None else first.count(b"\t") + 1
    if fields is not None and fields != len(CRITEO_COLUMNS):
        raise CriteoError(f"{path}:1: has {fields} tab-separated field(s); a Criteo line has "
                          f"{len(CRITEO_COLUMNS)} (label, I1..I13, C1..C26)")
    return lines + (last != b"\n")


def read_criteo(path: str | Path, layout: RecordLayout, first_line: int = 0, *,
                use_threads: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: the file's examples packed by ``layout`` (int64 (N, layout.width)) and their
    labels (float32 (N,)), from line ``first_line + 1`` on (line numbers in errors are the file's).
    CriteoError naming the file, line and field on bad input (module docstring).

    ``use_threads``: parse on pyarrow's CPU thread pool. Off by default because files are read by
    a background thread of a training process, sharing its cores with the training: there the CPU
    seconds a file costs count, not its wall time. A ``.tsv.gz`` is decompressed on one thread
    (pyarrow's read-ahead) either way, which bounds its wall time, so threads save it little; on a
    plain ``.tsv`` they save wall time for more CPU seconds."""
    import pyarrow as pa

    path = str(path)
    check_layout(layout, path)
    cats = [c.name for c in layout.categorical]
    # Categorical fields as binary, not string: no UTF-8 check (twice as fast), the same bytes.
    types = {"label": pa.int64(), **{n: pa.int64() for n in layout.dense}, **{n: pa.binary() for n in cats}}
    try:
        table = _read(path, types, first_line, use_threads)
    except pa.ArrowInvalid as exc:
        _diagnose(path, layout, first_line, exc)  # raises a CriteoError naming the line
        raise  # (never reached)
    except OSError as exc:
        raise CriteoError(f"{path}: cannot be read: {' '.join(str(exc).split())}") from exc

    def line(row: int) -> int:
        return first_line + row + 1

    y = table.column("label")
    if y.null_count:
        raise CriteoError(f"{path}:{line(_first(y.is_null()))}: label: missing: an empty line, or an empty label "
                          "field (every line starts with its label, 0 or 1)")
    y = y.to_numpy()
    if (bad := np.flatnonzero((y != 0) & (y != 1))).size:
        raise CriteoError(f"{path}:{line(int(bad[0]))}: label: {int(y[bad[0]])} is not 0 or 1")
    dense = np.empty((len(y), len(layout.dense)), dtype=np.float32)
    for j, name in enumerate(layout.dense):
        dense[:, j] = dense_transform(table.column(name).to_numpy(zero_copy_only=False))
    ids, weights = [], []
    ones = np.ones(len(y), dtype=np.int64)  # the lengths of every single-id column (pack only reads them)
    for col in layout.categorical:
        values, lengths = _column_ids(table.column(col.name), col, path, line)
        ids.append((values, ones if lengths is None else lengths))
        weights.append(np.ones(len(values), np.float32) if col.weighted else None)
    return layout.pack(dense, ids, weights), y.astype(np.float32)


def _read(path: str, types: dict[str, Any], first_line: int, use_threads: bool, handler: Any = None) -> Any:
    """pyarrow's CSV reader on a Criteo file: the ``types`` columns only; a line with the wrong
    number of fields stops it (``handler`` sees it first); an empty line is a row, not skipped (so
    that row numbers stay line numbers)."""
    import pyarrow.csv as pacsv

    def refuse(row: Any) -> str:
        return "error"

    with _stream(path) as s:
        return pacsv.read_csv(
            s,
            read_options=pacsv.ReadOptions(column_names=list(CRITEO_COLUMNS), skip_rows=first_line,
                                           use_threads=use_threads),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False,
                                             ignore_empty_lines=False, invalid_row_handler=handler or refuse),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(types),
                                                 null_values=[""], strings_can_be_null=False,
                                                 quoted_strings_can_be_null=False))


def _first(mask: Any) -> int:
    return int(np.argmax(np.asarray(mask)))


def _diagnose(path: str, layout: RecordLayout, first_line: int, exc: Exception) -> None:
    """The first bad line behind pyarrow's ``exc`` (which names no line): read again, one thread,
    every column as text, and find it. Raises CriteoError."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found: list[Any] = []

    def catch(row: Any) -> str:
        found.append(row)
        return "error"

    names = ["label", *layout.dense]
    try:
        table = _read(path, {n: pa.string() for n in names}, first_line, False, catch)
    except pa.ArrowInvalid:
        if found:
            row = found[0]
            raise CriteoError(f"{path}:{row.number}: has {row.actual_columns} tab-separated field(s); a Criteo line "
                              f"has {row.expected_columns} (label, I1..I13, C1..C26)") from None
        raise CriteoError(f"{path}: cannot be parsed: {' '.join(str(exc).split())}") from exc
    bad: list[tuple[int, str, str]] = []
    for name in names:
        col = table.column(name)
        ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, _INTEGER.pattern))
        if not pc.all(ok).as_py():
            row = _first(pc.invert(ok))
            bad.append((row, name, col[row].as_py()))
    if bad:
        row, name, value = min(bad, key=lambda b: (b[0], names.index(b[1])))
        raise CriteoError(f"{path}:{first_line + row + 1}: {name}: {value!r} is not an integer")
    raise CriteoError(f"{path}: cannot be parsed: {' '.join(str(exc).split())}") from exc


def _column_ids(column: Any, col: CategoricalColumn, path: str, line: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, lengths) of a categorical column's hex ids, lengths None when every field holds one
    id; CriteoError on a bad one."""
    values, lengths, base = [], [], 0
    for chunk in _batches(column):
        try:
            v, n = _hex_ids(chunk)
        except _BadId as bad:
            raise CriteoError(f"{path}:{line(base + bad.row)}: {col.name}: {bad.reason}") from None
        if n is not None and n.size and n.max() > col.max_ids:
            r = int(np.flatnonzero(n > col.max_ids)[0])
            raise CriteoError(f"{path}:{line(base + r)}: {col.name}: {int(n[r])} ids ({_text(chunk[r].as_py())!r}), "
                              f"more than the column's max_ids {col.max_ids}" + (
                                  " (a single-id column: raise its max_ids to read a comma-separated list)"
                                  if col.max_ids == 1 else ""))
        values.append(v)
        lengths.append(n)
        base += len(chunk)
    if len(values) == 1:  # (a file under _batches' limit: no copy)
        return values[0], lengths[0]
    if not values:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if all(n is None for n in lengths):
        return np.concatenate(values), None
    return np.concatenate(values), np.concatenate([np.ones(len(v), np.int64) if n is None else n
                                                   for v, n in zip(values, lengths, strict=True)])


def _batches(column: Any, limit: int = 1 << 28) -> Iterator[Any]:
    """The column's chunks (pyarrow's reader makes one per MB of text) joined into arrays of up to
    ``limit`` bytes of text: few calls, and 32-bit offsets that cannot overflow."""
    import pyarrow as pa

    group: list[Any] = []
    size = 0
    for chunk in column.chunks:
        nbytes = chunk.nbytes
        if group and size + nbytes > limit:
            yield pa.concat_arrays(group)
            group, size = [], 0
        group.append(chunk)
        size += nbytes
    if group:
        yield pa.concat_arrays(group) if len(group) > 1 else group[0]


class _BadId(ValueError):
    def __init__(self, row: int, reason: str):
        self.row, self.reason = row, reason
        super().__init__(f"row {row}: {reason}")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def hex_ids(strings: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values int64 flat, lengths int64 (N,)) of N fields of comma-separated hex ids (a pyarrow
    string array or a sequence of str): an empty field is one :data:`MISSING_ID`. ValueError
    (``row R: reason``) on a bad field. Vectorised over the array's bytes."""
    values, lengths = _hex_ids(strings)
    return values, np.ones(len(values), dtype=np.int64) if lengths is None else lengths


def _hex_ids(strings: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`hex_ids` with lengths None when every field holds one id (Criteo's single-id
    columns: the reader then shares one array of ones among them rather than making one each)."""
    import pyarrow as pa

    arr = strings if isinstance(strings, pa.Array) else pa.array(list(strings), type=pa.string())
    if arr.null_count:
        arr = arr.fill_null(b"" if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) else "")
    if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        offs_dtype: Any = np.int64
    elif pa.types.is_string(arr.type) or pa.types.is_binary(arr.type):
        offs_dtype = np.int32
    else:
        raise TypeError(f"hex ids are text, got a {arr.type} array")
    n = len(arr)
    offs = np.frombuffer(arr.buffers()[1], offs_dtype)[arr.offset:arr.offset + n + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8) if arr.buffers()[2] is not None else np.empty(0, np.uint8)
    data = data[int(offs[0]):int(offs[-1])]
    lens = np.diff(offs)
    full = lens == 8
    lists = False
    if len(data) == 8 * np.count_nonzero(full):  # Criteo's case: 8 digits or empty (no byte elsewhere)
        ids = _eight_digit_ids(data)
        if ids is not None:
            if len(ids) == n:  # no empty field
                return ids, None
            out = np.full(n, MISSING_ID, dtype=np.int64)
            out[full] = ids
            return out, None
    else:
        lists = bool(((lens % 9 == 8) | (lens == 0)).all())  # perhaps lists of 8-digit ids: checked below
    offs = offs - np.int64(offs[0])
    lens = lens.astype(np.int64, copy=False)
    if lists and (found := _eight_digit_lists(data, offs, lens)) is not None:
        return found
    return _hex_lists(data, offs, lens, arr)


def _eight_digit_ids(data: np.ndarray) -> np.ndarray | None:
    """int64 ids of ``data``, a run of 8-hex-digit ids without separators (uint8), or None when a
    byte is not a hex digit (the general case then names it)."""
    pairs = _PAIR.take(data.view("<u2"))  # two digits at a time: one table lookup per byte of the id
    if pairs.size and pairs.max() > 0xFF:
        return None
    return pairs.astype(np.uint8).view(">u4").astype(np.int64)


def _eight_digit_lists(data: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The multi-hot form of Criteo's case: every field empty (one :data:`MISSING_ID`) or a
    comma-separated list of 8-digit ids (its length ``9k - 1``, as the caller checked), a comma at
    every 9th byte of its field and nowhere else; None otherwise.

    Each id is read as the 8 bytes where it should start (an empty field's from
    :data:`_MISSING_DIGITS`, appended after the data), in list order: no pass that removes the
    commas. When every id read so is 8 hex digits, no comma sits inside an id, so the data holds
    ``sum(k - 1)`` commas only if each gap between two ids of a field holds one: counting the
    commas settles the rest."""
    count = (lens + 1) // 9  # ids per field (0 for an empty one)
    if np.count_nonzero(data == _COMMA) != int(count.sum()) - np.count_nonzero(count):
        return None
    lengths = np.maximum(count, 1)
    buf = np.concatenate([data, _MISSING_DIGITS])
    windows = np.ndarray((len(buf) - 7,), dtype="V8", buffer=buf, strides=(1,))  # the 8 bytes from each offset
    first = np.where(count > 0, offs[:-1], len(data))  # each field's first id
    starts = np.repeat(first - 9 * (np.cumsum(lengths) - lengths), lengths)
    starts += 9 * np.arange(len(starts))
    ids = _eight_digit_ids(windows[starts].view(np.uint8))
    if ids is None:
        return None
    return ids, lengths.astype(np.int64, copy=False)


def _hex_lists(data: np.ndarray, offs: np.ndarray, lens: np.ndarray, arr: Any) -> tuple[np.ndarray, np.ndarray]:
    """The general case of :func:`hex_ids`: any number of digits, comma-separated lists."""
    n = len(lens)
    comma = data == _COMMA
    nib = _LUT[data]
    field = np.repeat(np.arange(n), lens)  # the field of each byte
    if (bad := np.flatnonzero((nib == 255) & ~comma)).size:
        r = int(field[bad[0]])
        bad_id = next(t for t in _text(arr[r].as_py()).split(",")
                   if t and _LUT[np.frombuffer(t.encode(), np.uint8)].max() == 255)
        raise _BadId(r, f"{bad_id!r} is not a hexadecimal id")
    nonempty = lens > 0
    starts = offs[:-1][nonempty]
    ends = offs[1:][nonempty] - 1
    if (edge := np.flatnonzero(comma[starts] | comma[ends])).size:
        r = int(np.flatnonzero(nonempty)[edge[0]])
        raise _BadId(r, f"{_text(arr[r].as_py())!r} has an empty id (a multi-hot list is hex ids separated by single "
                        "commas)")
    begin = np.zeros(len(data), dtype=bool)  # the first byte of every id
    begin[starts] = True
    begin[1:] |= comma[:-1]
    token = np.cumsum(begin) - 1
    keep = ~comma
    tlen = np.bincount(token[keep], minlength=int(begin.sum()))
    if (short := np.flatnonzero(tlen == 0)).size:  # two commas in a row
        r = int(field[np.flatnonzero(begin)[short[0]]])
        raise _BadId(r, f"{_text(arr[r].as_py())!r} has an empty id (a multi-hot list is hex ids separated by single "
                        "commas)")
    if (long := np.flatnonzero(tlen > 16)).size:
        r = int(field[np.flatnonzero(begin)[long[0]]])
        raise _BadId(r, f"{_text(arr[r].as_py())!r} has an id of more than 16 hex digits (ids are 0 .. 2**63 - 1)")
    tk = token[keep]
    cs = np.cumsum(tlen) - tlen
    shift = (4 * (tlen[tk] - 1 - (np.arange(len(tk)) - cs[tk]))).astype(np.uint64)
    ids = np.bitwise_or.reduceat(nib[keep].astype(np.uint64) << shift, cs) if len(cs) else np.empty(0, np.uint64)
    if (big := np.flatnonzero(ids > np.uint64(2**63 - 1))).size:
        r = int(field[np.flatnonzero(begin)[big[0]]])
        raise _BadId(r, f"{_text(arr[r].as_py())!r} holds an id above 7fffffffffffffff (ids are 0 .. 2**63 - 1)")
    per_field = np.bincount(field[begin], minlength=n)
    lengths = np.where(nonempty, per_field, 1).astype(np.int64)
    out = np.full(int(lengths.sum()), MISSING_ID, dtype=np.int64)
    tfield = field[begin]
    rank = np.arange(len(tfield)) - (np.cumsum(per_field) - per_field)[tfield]
    out[(np.cumsum(lengths) - lengths)[tfield] + rank] = ids.astype(np.int64)
    return out, lengths
