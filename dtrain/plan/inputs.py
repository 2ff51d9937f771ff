"""The input plan: which shards of a sharded dataset each replica reads. Pure.

Each replica gets a disjoint set of shards (files, parquet row groups or a Dask collection's
partitions) with about the same number of rows: the shards go, largest first, to the replica with
the fewest rows so far (ties to the lower index), then each replica reads its own in file order
(reshuffled every epoch by the stream). ``dtrain plan`` prints the assignment; ``--json`` carries
it under ``"data"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dtrain.data.shards import Manifest, Shard
from dtrain.spec.errors import Problem, SpecError


@dataclass(frozen=True)
class ReplicaData:
    """One replica's share of the training shards."""

    task: str
    shards: tuple[str, ...]  # the shards' names (file, file#rgN, partition:N)
    rows: int
    parts: tuple[Shard, ...] = ()  # what the replica reads (paths, row groups, rows)


@dataclass(frozen=True)
class DataPlan:
    """The training shards and their assignment; the evaluation shards (streamed on the chief)."""

    source: str
    format: str
    shards: int
    rows: int
    replicas: tuple[ReplicaData, ...]
    eval_shards: int = 0
    eval_rows: int = 0
    eval_parts: tuple[Shard, ...] = ()
    # Set by the chief before the replicas start (not part of `dtrain plan`): the statistics pass's
    # standardisation and labels (dtrain.data.stats.DataStats), the columns every shard holds (a
    # Manifest without shards), and a Dask collection's partitions (pickled graphs).
    stats: Any = None
    schema: Manifest | None = None
    partitions: bytes = b""


def assign_shards(rows: Sequence[int], num_replicas: int) -> list[list[int]]:
    """Shard indices per replica: disjoint, row-balanced (largest first to the least loaded replica),
    each list in index order. Every replica gets at least one shard (ValueError otherwise)."""
    if len(rows) < num_replicas:
        raise ValueError(f"{len(rows)} shard(s) for {num_replicas} replicas: every replica reads whole shards and "
                         "needs at least one")
    load = [0] * num_replicas
    out: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        r = min(range(num_replicas), key=lambda r: (load[r], len(out[r]), r))
        out[r].append(i)
        load[r] += rows[i]
    return [sorted(ix) for ix in out]


def plan_data(train: Manifest, tasks: Sequence[str], test: Manifest | None = None) -> DataPlan:
    """The :class:`DataPlan` for ``train`` over the replicas on ``tasks`` (SpecError at ``data.source``
    when there are fewer shards than replicas)."""
    try:
        groups = assign_shards([s.rows for s in train.shards], len(tasks))
    except ValueError as exc:
        raise SpecError([Problem(f"{train.source!r}: {exc}: write more files (or parquet row groups), or use fewer "
                                 "worker tasks", path="data.source")]) from None
    replicas = []
    for task, idx in zip(tasks, groups, strict=True):
        parts = tuple(train.shards[i] for i in idx)
        replicas.append(ReplicaData(task, tuple(p.name for p in parts), sum(p.rows for p in parts), parts))
    test_parts = tuple(test.shards) if test is not None else ()
    return DataPlan(train.source, train.fmt, len(train.shards), train.rows, tuple(replicas), len(test_parts),
                    sum(p.rows for p in test_parts), test_parts, schema=replace(train, shards=()))


def data_json(data: DataPlan) -> dict[str, Any]:
    """``dtrain plan --json``'s ``"data"``: shards, rows and each replica's task, shards and rows."""
    return {"source": data.source, "format": data.format, "shards": data.shards, "rows": data.rows,
            "replicas": [{"task": r.task, "shards": list(r.shards), "rows": r.rows} for r in data.replicas],
            "eval": {"shards": data.eval_shards, "rows": data.eval_rows}}


def format_data(data: DataPlan | None, limit: int = 6) -> list[str]:
    """``dtrain plan``'s text lines for the input plan (each replica's first ``limit`` shards)."""
    if data is None:
        return []
    lines = [f"data: {data.source} ({data.format}): {data.shards} shard(s), {data.rows} rows"
             + (f"; evaluation: {data.eval_shards} shard(s), {data.eval_rows} rows" if data.eval_shards else "")]
    for r in data.replicas:
        names = ", ".join(r.shards[:limit]) + (f", ... ({len(r.shards)} in all)" if len(r.shards) > limit else "")
        lines.append(f"  {r.task:<18} {r.rows:>10} rows  {names}")
    return lines
