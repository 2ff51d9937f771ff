"""The chief's side of a sharded dataset: its manifests, the statistics pass with Dask, and Dask
collections given to ``dtrain.run(spec, data=...)``.

For files (``data.source`` a glob, directory or URL) the manifest comes from the headers
(``dtrain.data.shards``) and the statistics from one Dask task per training shard
(``dtrain.data.stats``), run on local threads before any cluster starts: a dataset that cannot
train is an exit-2 error then. For a Dask collection (a ``dask.dataframe.DataFrame`` with the
feature columns and ``data.target``, or ``(X, y)`` ``dask.array``s) each partition is a shard: one
pass on the cluster counts its rows and sums its moments; each replica later computes its own
partitions on its own worker, one at a time, as its readers reach them (``dtrain.worker.tasks``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal, overload

import cloudpickle
import numpy as np

from dtrain.data.shards import Manifest, Shard, ShardError, is_sharded, manifest_for, read_shard, split_eval
from dtrain.data.stats import DataStats, Moments, finish, moments
from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

COLLECTION_SOURCE = "dask-collection"
"""``data.source`` as plans and summaries show a Dask collection passed to ``dtrain.run``."""


@dataclass(frozen=True)
class DataInput:
    """A sharded dataset ready to plan and train on."""

    train: Manifest
    test: Manifest | None
    stats: DataStats
    partitions: bytes = b""  # a collection's partitions (pickled Dask graphs, by index), for the replicas

    @property
    def manifests(self) -> tuple[Manifest, Manifest | None]:
        return self.train, self.test


def sharded(spec: PipelineSpec) -> bool:
    return spec.model is not None and is_sharded(spec.data.source, spec.base_dir)


@overload
def file_input(spec: PipelineSpec, with_stats: Literal[True] = ...) -> DataInput: ...
@overload
def file_input(spec: PipelineSpec, with_stats: Literal[False]) -> tuple[Manifest, Manifest | None]: ...
def file_input(spec: PipelineSpec, with_stats: bool = True) -> DataInput | tuple[Manifest, Manifest | None]:
    """The manifests of ``spec``'s sharded files (ShardError naming the file on a bad header) and,
    ``with_stats``, the statistics pass (ValueError naming the problem)."""
    d = spec.data
    base = str(spec.base_dir)
    layout = record_layout_of(spec)
    manifest = _as_ids(manifest_for(d.source, base, d.target, layout=layout), spec)
    if d.eval_source is not None:
        test = _as_ids(manifest_for(d.eval_source, base, d.target, layout=layout), spec)
        if (test.fmt, test.features, test.target) != (manifest.fmt, manifest.features, manifest.target):
            raise ShardError(f"data.eval_source {d.eval_source!r} ({test.fmt}: {', '.join(test.features)}) does not "
                             f"match data.source ({manifest.fmt}: {', '.join(manifest.features)})")
        train = manifest
    else:
        train, test = split_eval(manifest, d.test_fraction, spec.training.seed, spec.num_replicas())
    if not with_stats:
        return train, test
    return DataInput(train, test, file_stats(train, d.standardize, d.task, d.readers))


def record_layout_of(spec: PipelineSpec) -> Any:
    """The packed record of a model with ``model.features`` (``dtrain.data.features.RecordLayout``), or None."""
    features = spec.model.features if spec.model is not None else None
    if features is None:
        return None
    from dtrain.model.recommendation import record_layout

    return record_layout(features.model_dump())


def _as_ids(manifest: Manifest, spec: PipelineSpec) -> Manifest:
    """Integer features are ids when the model takes ids (an embedding table first), numbers
    otherwise (as for a file held in memory); float features for a model that takes ids: ShardError."""
    from dtrain.plan.job import id_rows_of

    takes_ids = id_rows_of(spec) is not None
    if takes_ids and not manifest.ids:
        raise ShardError(f"{manifest.source!r}: the model takes integer ids (an embedding table first), but its "
                         f"feature columns are not all integers ({', '.join(manifest.features[:5])}...): store "
                         "the ids as integer columns")
    return replace(manifest, ids=takes_ids)


@lru_cache(maxsize=4)
def file_stats(train: Manifest, standardize: bool, task: str | None, readers: int) -> DataStats:
    """One pass over the training shards with Dask (one task per shard, ``readers`` threads); none
    for packed recommendation records (``Manifest.layout``: ids, never standardised, binary labels
    as numbers unless ``data.task`` says classification), so a large dataset is not read at start:
    a bad line then fails the run when a replica reads it, after a checkpoint."""
    import dask

    if train.layout is not None:
        if task == "classification":
            return DataStats(train.rows, task, 2, (0, 1), train.feature_shape, True)
        return DataStats(train.rows, task or "regression", None, None, train.feature_shape, True)

    parts = [dask.delayed(_shard_moments)(train, s) for s in train.shards]
    total = dask.delayed(_sum)(parts)
    (m,) = dask.compute(total, scheduler="threads", num_workers=max(1, readers))
    return finish(m, feature_shape=train.feature_shape, ids=train.ids, standardize=standardize, task=task)


def _shard_moments(manifest: Manifest, shard: Shard) -> Moments:
    x, y = read_shard(manifest, shard)
    return moments(x, y)


def _sum(parts: list[Moments]) -> Moments:
    total = Moments()
    for m in parts:
        total = total + m
    return total


# ------------------------------------------------------------------------------ Dask collections


def _as_xy(part: Any, target: str) -> tuple[np.ndarray, np.ndarray]:
    """A partition as (x, y): a pandas DataFrame (feature columns and ``target``) or an (X, y) pair."""
    if isinstance(part, tuple):
        x, y = part
        return np.asarray(x).reshape(len(x), -1), np.asarray(y).reshape(len(y))
    features = [c for c in part.columns if c != target]
    return part[features].to_numpy(), part[target].to_numpy()


def _partitions(data: Any, target: str) -> tuple[list[Any], tuple[str, ...]]:
    """(delayed (x, y) per partition, feature names) of a dask DataFrame or an (X, y) pair."""
    import dask

    if isinstance(data, tuple) and len(data) == 2:
        x, y = data
        if not (hasattr(x, "to_delayed") and hasattr(y, "to_delayed")):
            raise TypeError("data=(X, y) takes two dask.array.Array (X: rows x features, y: one label per row)")
        if x.ndim < 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"data=(X, y): X must be rows x features and y one label per row; got {x.shape} and "
                             f"{y.shape}")
        x = x.rechunk({i: -1 for i in range(1, x.ndim)})
        y = y.rechunk({0: x.chunks[0]})
        xs = x.to_delayed().reshape(-1)
        parts = [dask.delayed(tuple)([a, b]) for a, b in zip(xs, y.to_delayed().reshape(-1), strict=True)]
        return parts, tuple(f"x{i}" for i in range(int(np.prod(x.shape[1:]))))
    if not hasattr(data, "to_delayed") or not hasattr(data, "columns"):
        raise TypeError(f"data= takes a dask.dataframe.DataFrame or a (X, y) pair of dask arrays, got "
                        f"{type(data).__name__}")
    if target not in data.columns:
        raise ValueError(f"the DataFrame has no target column {target!r} (data.target); columns: "
                         + ", ".join(map(str, data.columns)))
    features = tuple(str(c) for c in data.columns if c != target)
    if not features:
        raise ValueError(f"the DataFrame has no feature columns besides the target {target!r}")
    return list(data.to_delayed()), features


def collection_input(spec: PipelineSpec, client: Any, data: Any) -> DataInput:
    """Partitions of ``data`` as shards: one pass on the cluster for their rows and moments."""
    import dask

    from dtrain.plan.job import id_rows_of

    d = spec.data
    parts, features = _partitions(data, d.target)
    xy = [dask.delayed(_as_xy)(p, d.target) for p in parts]
    counted = client.gather(client.compute([dask.delayed(_moments_xy)(p) for p in xy]))
    first = client.compute(xy[0]).result()
    ids = id_rows_of(spec) is not None
    if ids and first[0].dtype.kind not in "iu":
        raise ValueError(f"the model takes integer ids (an embedding table first), but the collection's features "
                         f"are {first[0].dtype}")
    shards = tuple(Shard(f"partition:{i}", m.count, i) for i, m in enumerate(counted) if m.count)
    if not shards:
        raise ShardError("the Dask collection holds no rows")
    manifest = Manifest(COLLECTION_SOURCE, "dask", shards, features, d.target, ids, (len(features),))
    train, test = split_eval(manifest, d.test_fraction, spec.training.seed, spec.num_replicas())
    keep = {s.part for s in train.shards}
    m = Moments()
    for i, part in enumerate(counted):
        if i in keep:
            m = m + part
    stats = finish(m, feature_shape=manifest.feature_shape, ids=ids, standardize=d.standardize, task=d.task)
    graphs = cloudpickle.dumps({i: p for i, p in enumerate(xy)})
    return DataInput(train, test, stats, graphs)


def _moments_xy(xy: tuple[np.ndarray, np.ndarray]) -> Moments:
    return moments(*xy)


def with_stats(plan: Plan, data: DataInput) -> Plan:
    """``plan`` with the statistics its replicas standardise and encode with."""
    assert plan.data is not None  # a plan of a sharded dataset
    return replace(plan, data=replace(plan.data, stats=data.stats, partitions=data.partitions))
