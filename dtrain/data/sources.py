"""Data sources: loading datasets into seeded train/test splits.

Pure numpy/torch (plus scikit-learn and pyarrow for sources); never imports Dask or the
spec.  Sources: ``synthetic``, ``sklearn:<name>`` (bundled datasets, no download), or a
path to a ``.npz`` / ``.csv`` / ``.parquet`` file (relative to ``base_dir``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

Task = Literal["classification", "regression"]

SKLEARN_DATASETS: tuple[str, ...] = ("digits", "iris", "wine", "breast_cancer", "diabetes")
"""Names accepted after ``sklearn:``; all bundled with scikit-learn (``diabetes`` is regression)."""

FILE_SUFFIXES: tuple[str, ...] = (".npz", ".csv", ".parquet")

CRITEO_SUFFIXES: tuple[str, ...] = (".tsv", ".tsv.gz")
"""Criteo-layout files (``dtrain.data.criteo``): always a sharded source, even one file, since they
are streamed (never loaded whole)."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded, split (and optionally standardised) dataset.

    ``x_*`` are float32 with shape ``(N, *feature_shape)`` (int64, never standardised, when the
    file holds integer features: the ids of an embedding model); ``y_*`` are int64 class ids
    (``0..num_classes-1``) for classification, float32 for regression.  ``classes`` holds the
    original label of each class id; ``mean``/``std`` the training-split statistics used to
    standardise (None when not standardised).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: Task
    num_features: int
    num_classes: int | None
    feature_shape: tuple[int, ...]
    classes: tuple[Any, ...] | None = None
    mean: np.ndarray | None = field(default=None, repr=False)
    std: np.ndarray | None = field(default=None, repr=False)


def data_source_kind(source: str) -> Literal["synthetic", "sklearn", "file"]:
    """``"synthetic"``, ``"sklearn"`` (``sklearn:<name>``) or ``"file"`` (anything else)."""
    if source == "synthetic":
        return "synthetic"
    if source.startswith("sklearn:"):
        return "sklearn"
    return "file"


def resolve_data_path(source: str, base_dir: str | Path = ".") -> Path | None:
    """The file a source names (relative paths resolved against ``base_dir``); None otherwise."""
    if data_source_kind(source) != "file":
        return None
    path = Path(source).expanduser()
    return path if path.is_absolute() else Path(base_dir) / path


def check_source(source: str, base_dir: str | Path = ".") -> None:
    """Cheap checks without loading: known sklearn name, supported suffix, existing file.

    Raises ``ValueError`` or ``FileNotFoundError`` with a message naming the problem.
    """
    kind = data_source_kind(source)
    if kind == "sklearn":
        name = source.split(":", 1)[1]
        if name not in SKLEARN_DATASETS:
            raise ValueError(
                f"unknown scikit-learn dataset {name!r}; known: "
                + ", ".join(f"sklearn:{n}" for n in SKLEARN_DATASETS)
            )
    elif kind == "file":
        path = resolve_data_path(source, base_dir)
        assert path is not None
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise ValueError(
                f"data source {source!r} is not 'synthetic', 'sklearn:<name>' or a "
                f"{'/'.join(FILE_SUFFIXES)} file"
            )
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")


# --------------------------------------------------------------------------- sources


def _synthetic(
    rng: np.random.Generator, task: Task, n: int, features: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, features))
    if task == "regression":
        w = rng.standard_normal(features) / math.sqrt(features)
        y = x @ w + 0.1 * rng.standard_normal(n)
        return x, y.astype(np.float32)
    # Gaussian blobs: class centroids about 5.7 apart (independent of the dimension),
    # unit noise -> linearly separable up to a few percent, learnable by any MLP.
    centroids = rng.standard_normal((num_classes, features)) * (4.0 / math.sqrt(features))
    y = rng.permutation(np.arange(n) % num_classes)
    return centroids[y] + x, y.astype(np.int64)


def _bundled_digits() -> tuple[np.ndarray, np.ndarray] | None:
    """scikit-learn's digits read from its bundled file as ``load_digits`` reads it, without
    importing scikit-learn (1.5 s with scipy, in the chief and in every worker process)."""
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


def _sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "digits" and (bundled := _bundled_digits()) is not None:
        return bundled
    from sklearn import datasets

    loaders = {
        "digits": datasets.load_digits,
        "iris": datasets.load_iris,
        "wine": datasets.load_wine,
        "breast_cancer": datasets.load_breast_cancer,
        "diabetes": datasets.load_diabetes,
    }
    x, y = loaders[name](return_X_y=True)
    return np.asarray(x), np.asarray(y)


def _first_non_finite(a: np.ndarray) -> tuple[tuple[int, ...], Any, int] | None:
    """(index, value, count) of the first NaN or infinity in ``a``, or None when all are finite."""
    if a.dtype.kind not in "fc" or a.size == 0:
        return None
    bad = ~np.isfinite(a)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), a.shape))
    return index, a[index].item(), count


_FINITE_FIX = "data files must hold finite numbers (one NaN or inf spreads to its whole column when standardised " \
              "and makes every update NaN): fix or drop the row"


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = sorted(archive.files)
            if "x" not in keys or "y" not in keys:
                raise ValueError(f"{path}: a .npz data file must hold arrays 'x' and 'y'; found {keys}")
            x, y = archive["x"], archive["y"]
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path}: cannot read .npz file: {exc}") from exc
    if x.ndim < 2:
        raise ValueError(f"{path}: 'x' must be N x features (at least 2-D), got shape {x.shape}")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(
            f"{path}: 'y' must be 1-D with one entry per row of 'x' {x.shape}, got shape {y.shape}"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise ValueError(f"{path}: 'x' must be numeric, got dtype {x.dtype}")
    for name, a in (("x", x), ("y", y)):
        if (bad := _first_non_finite(a)) is not None:
            index, value, count = bad
            cell = f"row {index[0]}" + (f", column {int(np.ravel_multi_index(index[1:], a.shape[1:]))}"
                                        if a.ndim > 1 else "")
            raise ValueError(f"{path}: {name}[{', '.join(map(str, index))}] is {value} ({cell}; {count} non-finite "
                             f"value(s) in {name!r}); {_FINITE_FIX}")
    return x, y


def _table(path: Path, target: str) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    try:
        if path.suffix.lower() == ".csv":
            import pyarrow.csv as pacsv

            table = pacsv.read_csv(path)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{path}: cannot read {path.suffix} file: {exc}") from exc
    names = list(table.column_names)
    if target not in names:
        raise ValueError(
            f"{path}: target column {target!r} not found; columns: {', '.join(names) or '(none)'}"
        )
    features = [n for n in names if n != target]
    if not features:
        raise ValueError(f"{path}: no feature columns besides the target column {target!r}")
    def row(i: int) -> str:  # a CSV's data rows start on line 2, after the header
        return f"row {i} (line {i + 2})" if path.suffix.lower() == ".csv" else f"row {i}"

    def check_finite(name: str, values: np.ndarray) -> None:
        if (bad := _first_non_finite(values)) is not None:
            (i,), value, count = bad
            raise ValueError(f"{path}: {row(i)}, column {name!r} is {value} ({count} non-finite value(s) in that "
                             f"column); {_FINITE_FIX}")

    integer = all(pa.types.is_integer(table.column(n).type) for n in features)  # ids for an embedding table
    cols = []
    for name in features:
        col = table.column(name)
        if col.null_count:
            raise ValueError(f"{path}: feature column {name!r} has {col.null_count} missing values")
        if not (
            pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)
        ):
            raise ValueError(f"{path}: feature column {name!r} is not numeric ({col.type})")
        cols.append(col.to_numpy().astype(np.int64 if integer else np.float64))
        if not integer:
            check_finite(name, cols[-1])
    ycol = table.column(target)
    if ycol.null_count:
        raise ValueError(f"{path}: target column {target!r} has {ycol.null_count} missing values")
    y = np.asarray(ycol.to_numpy(zero_copy_only=False))
    check_finite(target, y)
    return np.stack(cols, axis=1), y


# --------------------------------------------------------------------------- loading


def _labels(
    y: np.ndarray, task: Task | None, where: str
) -> tuple[Task, np.ndarray, int | None, tuple[Any, ...] | None]:
    """Decide the task and encode targets: (task, y, num_classes, classes)."""
    integral = y.dtype.kind in "iub" or (
        y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0)
    )
    if task is None:
        task = "classification" if y.dtype.kind in "iubUSO" else "regression"
    if task == "regression":
        if y.dtype.kind not in "iubf":
            raise ValueError(f"{where}: regression targets must be numeric, got dtype {y.dtype}")
        return task, y.astype(np.float32), None, None
    if task != "classification":
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
    if y.dtype.kind == "f" and not integral:
        raise ValueError(f"{where}: classification targets must be integer class labels")
    if y.dtype.kind in "iubf" and len(y) and y.min() >= 0:
        y = y.astype(np.int64)
        num_classes = int(y.max()) + 1 if len(y) else 0
        return task, y, num_classes, tuple(range(num_classes))
    values, inverse = np.unique(y, return_inverse=True)
    return (
        task,
        inverse.astype(np.int64),
        len(values),
        tuple(v.item() if hasattr(v, "item") else v for v in values),
    )


def _split(
    n: int, y: np.ndarray, task: Task, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(n)
    if test_fraction == 0:
        return idx, idx[:0]
    from .split import split_indices  # scikit-learn's train_test_split, without importing it

    stratify = None
    if task == "classification":
        counts = np.bincount(y)
        counts = counts[counts > 0]
        n_test = math.ceil(test_fraction * n)
        if counts.min() >= 2 and len(counts) <= n_test and len(counts) <= n - n_test:
            stratify = y
    return split_indices(n, stratify, test_fraction, seed)


def load_dataset(
    source: str,
    *,
    base_dir: str | Path = ".",
    target: str = "label",
    test_fraction: float = 0.2,
    standardize: bool = True,
    seed: int = 0,
    task: Task | None = None,
    num_samples: int = 2048,
    num_features: int | None = None,
    num_classes: int = 10,
    feature_shape: Sequence[int] | None = None,
    id_rows: int | None = None,
    eval_source: str | None = None,
) -> Dataset:
    """Load ``source`` and split it (seeded; stratified for classification when possible).

    * ``synthetic``: ``num_samples`` x ``num_features`` (default 64, or prod(feature_shape))
      Gaussian blobs around ``num_classes`` centroids (learnable), or with
      ``task="regression"`` a noisy linear target.
    * ``sklearn:<name>`` for names in :data:`SKLEARN_DATASETS`.
    * ``.npz`` (arrays ``x``, ``y``), ``.csv`` / ``.parquet`` (feature columns + ``target``).
      Integer (or string) targets mean classification, float targets regression, unless
      ``task`` says otherwise.  Non-negative integer labels are kept as class ids
      (num_classes = max + 1); other labels are mapped to ``0..C-1`` in sorted order.

    ``id_rows``: the model takes integer ids into an embedding table of that many rows (its first
    layer): the features must be integers (an integer npz ``x``, integer csv/parquet feature
    columns) and every id in ``0..id_rows - 1``; they are kept as int64 and never standardised.
    ``0``: integer ids without a range check (a custom module's tables: what it looks up is its
    own computation; the ps checks each id).
    Otherwise integer features are numbers like any other (float32, standardised).

    ``feature_shape`` reshapes every sample (e.g. 64 features -> ``(1, 8, 8)`` for conv
    layers).  ``num_samples``/``num_classes`` only apply to ``synthetic``; ``num_features``,
    when given for another source, must match it.  Standardisation uses the training
    split's per-feature mean and std (std 0 -> 1) and is applied to both splits; targets
    are never standardised.

    ``eval_source``: a file of the same columns held out whole for evaluation instead of
    ``test_fraction`` of ``source`` (its labels mapped with the training file's, its features
    standardised with the training statistics).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for bad contents or
    arguments.
    """
    check_source(source, base_dir)
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    shape = tuple(int(d) for d in feature_shape) if feature_shape is not None else None
    if shape is not None and (not shape or min(shape) < 1):
        raise ValueError(f"feature_shape must be positive integers, got {list(shape)}")
    kind = data_source_kind(source)
    where = source
    if kind == "synthetic":
        features = num_features or (math.prod(shape) if shape else 64)
        if num_samples < 2 or features < 1 or (task != "regression" and num_classes < 2):
            raise ValueError("synthetic data needs num_samples >= 2, num_features >= 1, num_classes >= 2")
        x, y = _synthetic(
            np.random.default_rng(seed), task or "classification", num_samples, features, num_classes
        )
    elif kind == "sklearn":
        x, y = _sklearn(source.split(":", 1)[1])
    else:
        path = resolve_data_path(source, base_dir)
        assert path is not None
        where = str(path)
        x, y = _npz(path) if path.suffix.lower() == ".npz" else _table(path, target)
    if len(x) < 2:
        raise ValueError(f"{where}: need at least 2 samples, got {len(x)}")
    held = 0  # rows of eval_source, appended after the training rows (one label mapping for both)
    if eval_source is not None:
        check_source(eval_source, base_dir)
        path = resolve_data_path(eval_source, base_dir)
        if path is None:
            raise ValueError(f"eval_source {eval_source!r} must be a file like data.source")
        xe, ye = _npz(path) if path.suffix.lower() == ".npz" else _table(path, target)
        if xe.shape[1:] != x.shape[1:]:
            raise ValueError(f"{path}: its examples have shape {tuple(xe.shape[1:])}, those of {where} "
                             f"{tuple(x.shape[1:])}: the evaluation file needs the training file's features")
        held = len(xe)
        x, y = np.concatenate([x, xe.astype(x.dtype, copy=False)]), np.concatenate([y, ye])
    flat = math.prod(x.shape[1:])
    if num_features is not None and kind != "synthetic" and num_features != flat:
        raise ValueError(f"{where}: has {flat} features, but num_features is {num_features}")
    if shape is not None:
        if math.prod(shape) != flat:
            raise ValueError(
                f"{where}: feature_shape {list(shape)} needs {math.prod(shape)} features, data has {flat}"
            )
        x = x.reshape(len(x), *shape)
    ids = id_rows is not None  # ids into an embedding table: kept exact, never standardised
    if id_rows is not None:
        _check_ids(x, int(id_rows), where, kind)
    task, y, n_classes, classes = _labels(y, task, where)
    if held:
        train, test = np.arange(len(x) - held), np.arange(len(x) - held, len(x))
    else:
        train, test = _split(len(x), y, task, test_fraction, seed)
    x = x.astype(np.int64 if ids else np.float64)
    x_train, x_test = x[train], x[test]
    mean = std = None
    if standardize and not ids:
        mean = x_train.mean(axis=0)
        std = x_train.std(axis=0)
        std[std == 0] = 1.0
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
        mean, std = mean.astype(np.float32), std.astype(np.float32)
    return Dataset(
        x_train=np.ascontiguousarray(x_train, dtype=np.int64 if ids else np.float32),
        y_train=y[train],
        x_test=np.ascontiguousarray(x_test, dtype=np.int64 if ids else np.float32),
        y_test=y[test],
        task=task,
        num_features=flat,
        num_classes=n_classes,
        feature_shape=tuple(int(d) for d in x.shape[1:]),
        classes=classes,
        mean=mean,
        std=std,
    )


def _check_ids(x: np.ndarray, rows: int, where: str, kind: str) -> None:
    """Embedding ids: integers in ``0..rows - 1`` (the first bad one named by row and field)."""
    if x.dtype.kind not in "iu":
        what = ("its features are float" if kind != "file" else
                f"its features are {x.dtype} (store the ids as integers: an integer npz 'x', integer csv/parquet "
                "columns)")
        model = "model.layers[0] is an embedding table" if rows else "model.module has sparse embeddings"
        raise ValueError(f"{where}: {model}, which takes integer ids, but {what}")
    if rows <= 0:
        return
    flat = x.reshape(len(x), -1)
    bad = (flat < 0) | (flat >= rows)
    if bad.any():
        row, field = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"{where}: row {row}, field {field} holds id {int(flat[row, field])}, outside the embedding "
                         f"table's {rows} rows (ids 0..{rows - 1}; {int(bad.sum())} such id(s)): raise "
                         "num_embeddings or map the ids into the table (e.g. id % num_embeddings)")


def to_tensors(
    x: np.ndarray, y: np.ndarray, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch tensors: float32 ``x`` (int64 for integer ids); int64 ``y`` for integer labels, float32 otherwise."""
    tx = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64 if x.dtype.kind in "iu" else np.float32))
    y = np.ascontiguousarray(y)
    ty = torch.from_numpy(y.astype(np.int64) if y.dtype.kind in "iub" else y.astype(np.float32))
    return tx.to(device), ty.to(device)
