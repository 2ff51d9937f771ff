"""What training needs to know about a sharded dataset before it starts, in one pass over the shards.

Each shard gives its :class:`Moments` (count, per-feature sum and sum of squares, the labels' range
and kind); they add up (the chief runs one task per shard with Dask: ``dtrain.chief.inputs``) into
:class:`DataStats`: the standardisation (mean, std), the task, the classes. :func:`make_transform`
turns a shard's raw (x, y) into training arrays with them. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LABELS = 100_000  # distinct non-integer labels kept per pass (class names)


@dataclass
class Moments:
    """A shard's (or several shards') sufficient statistics."""

    count: int = 0
    sum: np.ndarray | None = None
    sumsq: np.ndarray | None = None
    y_kind: str = ""  # numpy dtype kind of the labels
    y_min: float = float("inf")
    y_max: float = float("-inf")
    y_integral: bool = True
    labels: set[Any] = field(default_factory=set)  # non-numeric labels

    def __add__(self, other: Moments) -> Moments:
        if not self.count:
            return other
        if not other.count:
            return self
        assert self.sum is not None and self.sumsq is not None and other.sum is not None and other.sumsq is not None
        kind = self.y_kind if self.y_kind == other.y_kind else ("O" if "O" in (self.y_kind, other.y_kind) else "f")
        return Moments(self.count + other.count, self.sum + other.sum, self.sumsq + other.sumsq, kind,
                       min(self.y_min, other.y_min), max(self.y_max, other.y_max),
                       self.y_integral and other.y_integral, self.labels | other.labels)


def moments(x: np.ndarray, y: np.ndarray) -> Moments:
    """One shard's :class:`Moments` (x: N x features, y: N labels)."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    y = np.asarray(y)
    m = Moments(len(x), x.sum(axis=0), np.square(x).sum(axis=0), y.dtype.kind)
    if not len(y):
        return m
    if y.dtype.kind in "iubf":
        m.y_min, m.y_max = float(y.min()), float(y.max())
        m.y_integral = y.dtype.kind in "iub" or bool(np.all(np.mod(y, 1) == 0))
    else:
        m.labels = set(np.unique(y.astype(str)).tolist())
        if len(m.labels) > MAX_LABELS:
            raise ValueError(f"more than {MAX_LABELS} distinct labels: not class labels")
    return m


@dataclass(frozen=True)
class DataStats:
    """The training shards' standardisation and label encoding."""

    samples: int
    task: str  # classification | regression
    num_classes: int | None
    classes: tuple[Any, ...] | None
    feature_shape: tuple[int, ...]
    ids: bool  # integer ids for embedding tables (never standardised)
    mean: np.ndarray | None = None
    std: np.ndarray | None = None


def finish(m: Moments, *, feature_shape: tuple[int, ...], ids: bool, standardize: bool,
           task: str | None = None) -> DataStats:
    """:class:`DataStats` from the summed moments (ValueError for labels that fit no task)."""
    if not m.count:
        raise ValueError("the training shards hold no samples")
    numeric = m.y_kind in "iubf" and not m.labels
    if task is None:
        task = "classification" if (m.y_kind in "iub" or not numeric) else "regression"
    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    if standardize and not ids:
        assert m.sum is not None and m.sumsq is not None  # (rows counted)
        mean = m.sum / m.count
        var = np.maximum(m.sumsq / m.count - np.square(mean), 0.0)
        std = np.sqrt(var)
        std[std == 0] = 1.0
        mean, std = mean.astype(np.float32), std.astype(np.float32)
    if task == "regression":
        if not numeric:
            raise ValueError("regression targets must be numeric")
        return DataStats(m.count, task, None, None, feature_shape, ids, mean, std)
    if numeric:
        if not m.y_integral or m.y_min < 0:
            raise ValueError("classification targets must be non-negative integer class labels "
                             f"(found labels from {m.y_min:g} to {m.y_max:g})")
        n = int(m.y_max) + 1
        return DataStats(m.count, task, n, tuple(range(n)), feature_shape, ids, mean, std)
    classes = tuple(sorted(m.labels))
    return DataStats(m.count, task, len(classes), classes, feature_shape, ids, mean, std)


def make_transform(stats: DataStats) -> Any:
    """``(x, y) -> (x, y)`` for training: float32 features (standardised) or int64 ids, reshaped to
    the feature shape; int64 class ids or float32 regression targets. A float32 ``x`` is
    standardised in place (it is a shard just read)."""
    names = np.asarray(stats.classes, dtype=str) if stats.classes and not isinstance(stats.classes[0], int) else None

    def transform(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x)
        if stats.ids:
            x = x.astype(np.int64, copy=False)
        else:
            x = np.ascontiguousarray(x, dtype=np.float32)  # (x is a shard just read: changed in place)
            if stats.mean is not None:
                assert stats.std is not None  # (set together)
                x -= stats.mean.reshape(-1)
                x /= stats.std.reshape(-1)
        x = x.reshape(len(x), *stats.feature_shape)
        y = np.asarray(y)
        if stats.task == "regression":
            return np.ascontiguousarray(x), y.astype(np.float32)
        if names is not None:
            idx = np.searchsorted(names, y.astype(str))
            if np.any(idx >= len(names)) or np.any(names[np.minimum(idx, len(names) - 1)] != y.astype(str)):
                raise ValueError("a label outside the classes the statistics pass found")
            return np.ascontiguousarray(x), idx.astype(np.int64)
        return np.ascontiguousarray(x), y.astype(np.int64)

    return transform
