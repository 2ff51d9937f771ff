"""Sharded datasets: finding the files, reading their headers, checking they agree, reading one shard.

A *sharded* source is a glob, a directory or a filesystem URL (anything fsspec understands:
``s3://…``, ``gs://…``, local paths) of ``.parquet``, ``.csv`` or ``.npz`` files, or Criteo-layout
``.tsv`` / ``.tsv.gz`` files (format ``criteo``; even a single one). Its :class:`Manifest` lists the
shards — one per parquet row group, one per CSV, npz or Criteo file, one per partition of a Dask
collection — with their row counts, read from the headers only (a CSV's rows are counted by
parsing it as ``read_shard`` does, a Criteo file's by its newlines), and the columns every file must share. With a
:class:`~dtrain.data.features.RecordLayout` (recommendation records: Criteo files, or parquet with
dense, id, list and string columns) a shard reads as packed int64 rows. Nothing here imports Dask:
the compiler assigns the shards to replicas (``dtrain.plan.inputs``), each replica streams its own
(``dtrain.data.stream``).
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BadRecordError, BadShardError, ShardError  # noqa: F401 (re-exported: their home before)
from .sources import CRITEO_SUFFIXES, FILE_SUFFIXES, data_source_kind

if TYPE_CHECKING:
    from .features import RecordLayout

GLOB_CHARS = "*?["
# Directory entries ``check_source`` (``dtrain validate``) looks at, at most: a source such as ``/``
# would otherwise be listed whole. A larger listing is left to the run (its preflight lists it).
LISTING_LIMIT = 20_000


SHARD_SUFFIXES: tuple[str, ...] = FILE_SUFFIXES + CRITEO_SUFFIXES
_FORMATS = {".tsv": "criteo", ".tsv.gz": "criteo"}


def suffix(path: str) -> str:
    """A shard file's suffix, lower case (``.tsv.gz`` counts as one)."""
    name = path.rsplit("/", 1)[-1].lower()
    return ".tsv.gz" if name.endswith(".tsv.gz") else Path(name).suffix


def file_format(path: str) -> str:
    """``parquet``, ``csv``, ``npz`` or ``criteo`` (``.tsv``/``.tsv.gz``)."""
    s = suffix(path)
    return _FORMATS.get(s, s.lstrip("."))


@dataclass(frozen=True)
class Shard:
    """One unit of assignment: a file, a parquet row group, or a Dask collection's partition."""

    path: str
    rows: int
    part: int | None = None  # parquet row group, or the partition's index

    @property
    def name(self) -> str:
        """How ``dtrain plan`` and errors name it: the file's name, ``#rg<N>`` for a row group."""
        base = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("partition:"):
            return self.path
        return base if self.part is None else f"{base}#rg{self.part}"


@dataclass(frozen=True)
class Manifest:
    """Every shard of a source, in file order, and what each sample holds."""

    source: str
    fmt: str  # parquet | csv | npz | criteo | dask
    shards: tuple[Shard, ...]
    features: tuple[str, ...]  # column names (npz: ("x",); with a layout: its dense then categorical ones)
    target: str
    ids: bool  # integer features: ids for embedding tables (never standardised)
    feature_shape: tuple[int, ...]
    layout: RecordLayout | None = None  # recommendation records: x is rows packed by it (width int64)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)


def is_sharded(source: str, base_dir: str | Path = ".") -> bool:
    """Whether ``source`` names a set of shards: a glob, a directory, a URL (``s3://…``), or
    Criteo-layout files (``.tsv``, ``.tsv.gz``: always streamed)."""
    if data_source_kind(source) != "file":
        return False
    if source.lower().endswith(CRITEO_SUFFIXES):
        return True
    if "://" in source or any(c in source for c in GLOB_CHARS) or source.endswith("/"):
        return True
    path = Path(source).expanduser()
    return (path if path.is_absolute() else Path(base_dir) / path).is_dir()


def _url(source: str, base_dir: str | Path) -> str:
    if "://" in source:
        return source
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else Path(base_dir) / path)


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def discover(source: str, base_dir: str | Path = ".") -> list[str]:
    """The files ``source`` names, sorted (ShardError: none, or a mix of formats)."""
    url = _url(source, base_dir)
    fs, path = _fs(url)
    if any(c in path for c in GLOB_CHARS):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if suffix(p) in SHARD_SUFFIXES]
    else:
        found = [path] if fs.exists(path) else []
    files = sorted(p for p in found if fs.isfile(p) and suffix(p) in SHARD_SUFFIXES)
    if not files:
        raise ShardError(f"no {'/'.join(SHARD_SUFFIXES)} file matches {source!r} (looked in {url}; relative paths "
                         "are relative to the pipeline file's directory)")
    suffixes = sorted({suffix(p) for p in files})
    if len({file_format(p) for p in files}) > 1:
        raise ShardError(f"{source!r} matches files of several formats ({', '.join(suffixes)}): one format per "
                         "dataset; narrow the pattern, e.g. *.parquet")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return [p if protocol in ("file", "local") else f"{protocol}://{p}" for p in files]


def check_source(source: str, base_dir: str | Path = ".") -> bool:
    """:func:`discover`'s check for ``dtrain validate`` on a local source, bounded: True when it
    matches shard files of one format, False when its directory tree holds more than
    ``LISTING_LIMIT`` entries (not listed here: the run lists it), ShardError as ``discover``."""
    import os

    path = _url(source, base_dir)
    cut = min((path.find(c) for c in GLOB_CHARS if c in path), default=-1)
    root = path if cut < 0 else os.path.dirname(path[:cut]) or "."
    recursive = cut < 0 or "**" in path
    if os.path.isdir(root):
        seen = 0
        for _dir, dirs, files in os.walk(root):
            seen += len(dirs) + len(files)
            if seen > LISTING_LIMIT:
                return False
            if not recursive:
                break
    discover(source, base_dir)
    return True


def _open(path: str) -> Any:
    fs, p = _fs(path)
    return fs.open(p, "rb")


def _parquet_header(path: str) -> tuple[list[tuple[str, str]], list[int]]:
    import pyarrow.parquet as pq

    with _open(path) as f:
        meta = pq.ParquetFile(f).metadata
        schema = meta.schema.to_arrow_schema()
        return ([(n, str(t)) for n, t in zip(schema.names, schema.types, strict=True)],
                [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])


def _csv_header(path: str) -> tuple[list[tuple[str, str]], int]:
    import pyarrow.csv as pacsv

    # Rows as read_shard's parser reads them (streamed, a block at a time): newlines alone miscount
    # carriage-return line ends, blank lines and quoted values that span lines.
    with _open(path) as f:
        reader = pacsv.open_csv(f)  # types from the first block
        schema = reader.schema
        rows = sum(batch.num_rows for batch in reader)
    return [(n, str(t)) for n, t in zip(schema.names, schema.types, strict=True)], rows


def _npy_header(archive: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    with archive.open(f"{name}.npy") as member:
        fmt = np.lib.format
        version = fmt.read_magic(member)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _fortran, dtype = read(member)  # the header only, never the array
    return tuple(shape), dtype


def _npz_header(path: str) -> tuple[list[tuple[str, str]], int, tuple[int, ...]]:
    with _open(path) as f, zipfile.ZipFile(f) as archive:
        names = {n[:-4] for n in archive.namelist() if n.endswith(".npy")}
        if not {"x", "y"} <= names:
            raise ShardError(f"{path}: a .npz shard must hold arrays 'x' and 'y'; found {sorted(names)}")
        xs, xd = _npy_header(archive, "x")
        ys, yd = _npy_header(archive, "y")
    if len(xs) < 2 or ys[:1] != xs[:1]:
        raise ShardError(f"{path}: 'x' must be N x features and 'y' hold one entry per row; got {xs} and {ys}")
    return [("x", f"{xd}{list(xs[1:])}"), ("y", str(yd))], xs[0], xs[1:]


def _integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def read_manifest(source: str, base_dir: str | Path = ".", target: str = "label",
                  files: list[str] | None = None, layout: RecordLayout | None = None) -> Manifest:
    """Discover ``source``'s files and read their headers (ShardError naming the file and the
    columns when they disagree with the first file, or the target is missing). ``layout``: the
    files hold recommendation records (Criteo files need one; parquet may have one), read as rows
    packed by it."""
    files = discover(source, base_dir) if files is None else files
    fmt = file_format(files[0])
    if fmt == "criteo":
        return _criteo_manifest(source, files, target, layout)
    if layout is not None and fmt != "parquet":
        raise ShardError(f"{files[0]}: model.features (a record layout) reads Criteo .tsv/.tsv.gz files or parquet "
                         f"files, not {fmt}: write the records as parquet")
    shards: list[Shard] = []
    first: list[tuple[str, str]] | None = None
    shape: tuple[int, ...] = ()
    for path in files:
        try:
            if fmt == "parquet":
                columns, groups = _parquet_header(path)
                shards += [Shard(path, n, i) for i, n in enumerate(groups) if n]
            elif fmt == "csv":
                columns, rows = _csv_header(path)
                shards += [Shard(path, rows)] if rows else []
            else:
                columns, rows, shape = _npz_header(path)
                shards += [Shard(path, rows)] if rows else []
        except ShardError:
            raise
        except Exception as exc:
            raise ShardError(f"{path}: cannot read its {fmt} header: {' '.join(str(exc).split())}") from exc
        if first is None:
            first = columns
            if fmt != "npz" and target not in dict(columns):
                raise ShardError(f"{path}: target column {target!r} not found; columns: "
                                 + ", ".join(n for n, _ in columns))
        elif columns != first:
            want, got = dict(first), dict(columns)
            diff = [f"{n} ({want.get(n, 'missing')} in {Path(files[0]).name}, {got.get(n, 'missing')} here)"
                    for n in dict.fromkeys([*want, *got]) if want.get(n) != got.get(n)]
            if not diff:  # the same columns in another order
                diff = [f"order {', '.join(got)} (vs {', '.join(want)})"]
            raise ShardError(f"{path}: its columns differ from the first file {files[0]}: {'; '.join(diff)}: every "
                             "shard needs the same columns and types")
    assert first is not None
    if not shards:
        raise ShardError(f"{source!r}: its {len(files)} file(s) hold no rows")
    if fmt == "npz":
        return Manifest(source, fmt, tuple(shards), ("x",), "y", _integer(first[0][1]), shape)
    if layout is not None:
        from .records import check_columns

        check_columns(files[0], dict(first), layout)
        return Manifest(source, fmt, tuple(shards), layout.names, target, True, (layout.width,), layout)
    features = tuple(n for n, _ in first if n != target)
    if not features:
        raise ShardError(f"{files[0]}: no feature columns besides the target column {target!r}")
    types = dict(first)
    bad = [f"{n} ({types[n]})" for n in features if not (_integer(types[n]) or types[n] in
                                                         ("float", "double", "halffloat", "bool"))]
    if bad:
        raise ShardError(f"{files[0]}: feature column(s) {', '.join(bad)} are not numeric")
    ids = all(_integer(types[n]) for n in features)
    return Manifest(source, fmt, tuple(shards), features, target, ids, (len(features),))


def _criteo_manifest(source: str, files: list[str], target: str, layout: RecordLayout | None) -> Manifest:
    """Criteo files: one shard per file, its rows its lines (a streaming count, files in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    from .criteo import check_layout

    if layout is None:
        raise ShardError(f"{source!r} is Criteo-layout data: declare the model's features (model.features) so "
                         "dtrain knows which columns to read")
    if target != "label":
        raise ShardError(f"{source!r} is Criteo-layout data, whose first field is the label, named 'label': set "
                         f"data.target: label (not {target!r})")
    try:
        check_layout(layout, source)
    except ValueError as exc:
        raise ShardError(str(exc)) from None
    with ThreadPoolExecutor(max_workers=min(8, len(files)), thread_name_prefix="dtrain-count") as pool:
        rows = list(pool.map(_count_lines, files))  # (gzip and pyarrow release the GIL)
    shards = tuple(Shard(path, n) for path, n in zip(files, rows, strict=True) if n)
    if not shards:
        raise ShardError(f"{source!r}: its {len(files)} file(s) hold no rows")
    return Manifest(source, "criteo", shards, layout.names, "label", True, (layout.width,), layout)


def _count_lines(path: str) -> int:
    from .criteo import count_lines

    try:
        return count_lines(path)
    except BadRecordError as exc:
        raise ShardError(str(exc)) from None
    except Exception as exc:
        raise ShardError(f"{path}: cannot count its lines: {' '.join(str(exc).split())}") from exc


def manifest_for(source: str, base_dir: str, target: str, *, layout: RecordLayout | None = None) -> Manifest:
    """:func:`read_manifest`, cached per process (validation, the plan and the chief share it) for
    as long as the files it matches are the same (names, and a local file's size and modification
    time): a file added, removed or rewritten since is seen by the next run of the same process."""
    return _manifest_cached(source, base_dir, target, _stamps(source, base_dir), layout=layout)


@lru_cache(maxsize=8)
def _manifest_cached(source: str, base_dir: str, target: str, stamps: tuple[tuple[str, int, int], ...], *,
                     layout: RecordLayout | None = None) -> Manifest:
    return read_manifest(source, base_dir, target, layout=layout)


def _stamps(source: str, base_dir: str) -> tuple[tuple[str, int, int], ...]:
    """The files ``source`` matches now, each with its size and modification time where local (a
    listing that fails is left to :func:`read_manifest` to report)."""
    import os

    try:
        files = discover(source, base_dir)
    except ShardError:
        return ()
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((f, st.st_size, st.st_mtime_ns))
        except OSError:  # (a URL: its name)
            out.append((f, -1, -1))
    return tuple(out)


def split_eval(manifest: Manifest, test_fraction: float, seed: int, min_train: int) -> tuple[Manifest, Manifest]:
    """(train, test): a seeded ``test_fraction`` of the shards held out for evaluation, at least one,
    leaving ``min_train`` for training (ShardError when there are too few)."""
    n = len(manifest.shards)
    n_test = max(1, round(test_fraction * n))
    if n - n_test < min_train:
        raise ShardError(f"{manifest.source!r} has {n} shard(s): holding out {n_test} for evaluation "
                         f"(test_fraction {test_fraction}) leaves fewer than the {min_train} replicas need (one "
                         "each): write more files or row groups, or set data.eval_source")
    test = set(np.random.default_rng([int(seed), 7]).choice(n, n_test, replace=False).tolist())

    def pick(keep: bool) -> Manifest:  # (replace: the layout, and any later field, comes along)
        return replace(manifest, shards=tuple(s for i, s in enumerate(manifest.shards) if (i in test) == keep))

    return pick(False), pick(True)


def read_shard(manifest: Manifest, shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """One shard's (x, y) as numpy: float features (as stored) or int64 ids, the raw targets. BadShardError
    naming the file when it cannot be read or does not match the manifest's columns. With a layout:
    the rows packed by it (int64) and float32 labels for Criteo files; BadRecordError naming the
    file, the line or row, and the column on a bad value."""
    layout = manifest.layout
    try:
        if manifest.fmt == "criteo":
            from .criteo import read_criteo

            if layout is None:
                raise ShardError(f"{shard.path}: a Criteo file is read with a layout (model.features)")
            x, y = read_criteo(shard.path, layout)
        elif manifest.fmt == "npz":
            with _open(shard.path) as f, np.load(f, allow_pickle=False) as archive:
                x, y = archive["x"], archive["y"]
            x = x.reshape(len(x), -1)
        else:
            first_row = 0
            if manifest.fmt == "parquet":
                import pyarrow.parquet as pq

                with _open(shard.path) as f:
                    pf = pq.ParquetFile(f)
                    group = shard.part or 0
                    first_row = sum(pf.metadata.row_group(i).num_rows for i in range(group))
                    table = pf.read_row_group(group, columns=None if layout is None else _layout_columns(
                        layout, manifest.target, pf.schema_arrow.names))
            else:
                import pyarrow.csv as pacsv

                with _open(shard.path) as f:
                    table = pacsv.read_csv(f)
            if layout is not None:
                from .records import read_records

                x = read_records(table, layout, shard.path, first_row)
            else:
                columns = [table.column(n).to_numpy(zero_copy_only=False) for n in manifest.features]
                dtype = np.int64 if manifest.ids else np.result_type(np.float32, *columns)
                x = np.empty((table.num_rows, len(columns)), dtype=dtype)  # C order: batches are rows
                for j, c in enumerate(columns):
                    x[:, j] = c
            y = np.asarray(table.column(manifest.target).to_numpy(zero_copy_only=False))
    except BadShardError:
        raise  # (a BadRecordError already names the file, the line and the column)
    except Exception as exc:
        raise BadShardError(f"{shard.name} ({shard.path}): cannot be read: {' '.join(str(exc).split())}") from exc
    if len(x) != shard.rows or len(y) != shard.rows:
        raise BadShardError(f"{shard.name} ({shard.path}): holds {len(x)} rows, its header said {shard.rows}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise BadShardError(f"{shard.name} ({shard.path}): holds NaN or infinite features")
    if y.dtype.kind == "f" and not np.isfinite(y).all():  # (a missing CSV value reads as NaN too)
        row = int(np.flatnonzero(~np.isfinite(y))[0])
        raise BadShardError(f"{shard.name} ({shard.path}): holds NaN or infinite targets ({manifest.target!r} "
                            f"of row {row} is {y[row]}): fix or drop those rows")
    if manifest.ids:
        return x.astype(np.int64, copy=False), y
    return (x if x.dtype.kind == "f" else x.astype(np.float32)), y  # floats as stored (float32 stays float32)


def _layout_columns(layout: RecordLayout, target: str, present: list[str]) -> list[str]:
    """The parquet columns a layout reads: its own, their weights, the target."""
    from .records import weights_column

    names = [*layout.names, *(weights_column(c.name) for c in layout.categorical if c.weighted), target]
    return [n for n in dict.fromkeys(names) if n in present]


ShardReader = Callable[[Shard], tuple[np.ndarray, np.ndarray]]
"""Reads one shard's raw (x, y): :func:`read_shard` for files, a Dask partition's fetch otherwise."""
