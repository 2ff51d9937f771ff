"""Where sparse embedding tables live: each table partitioned by rows over the ps tasks
(``placement.embedding_partition``: TensorFlow's ``mod`` and ``div``). Pure: nothing allocated.

A table never joins a shard's flat dense buffer: each ps task holds its part as its own (rows,
dim) tensor with per-row optimizer state (``dtrain.ps.rows``), and replicas move only the rows a
batch touches (docs/sparse.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtrain.model.tables import div_starts

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TablePartPlan:
    """One ps task's rows of a table."""

    part: int  # the part's index (== the ps task's index)
    shard: int  # index into Plan.shards
    task: str  # "/job:ps/task:1"
    rows: int
    bytes: int  # the rows' float32 bytes (optimizer state comes on top: docs/sparse.md)
    first: int  # div: its first global id; mod: its part index (ids first, first + P, ...)


@dataclass(frozen=True)
class TablePlan:
    """A sparse embedding table (a ``Table`` module) and its partitions."""

    name: str  # the weight's parameter name, e.g. "0.weight" (also its model.pt key)
    kind: str  # embedding | embedding_bag
    num_embeddings: int
    dim: int
    init_std: float
    mode: str
    partition: str  # mod | div
    parts: tuple[TablePartPlan, ...]

    @property
    def bytes(self) -> int:
        return self.num_embeddings * self.dim * FLOAT32_BYTES


def plan_tables(tables: list[tuple[str, Any]], ps_job: str, num_ps: int, partition: str) -> tuple[TablePlan, ...]:
    """``tables``: (name, Table module, possibly on the meta device) pairs; ps task ``p`` is shard ``p``."""
    out = []
    for name, t in tables:
        starts = div_starts(t.num_embeddings, num_ps)
        parts = []
        for p in range(num_ps):
            if partition == "div":
                rows, first = starts[p + 1] - starts[p], starts[p]
            else:
                rows, first = len(range(p, t.num_embeddings, num_ps)), p
            parts.append(TablePartPlan(p, p, f"/job:{ps_job}/task:{p}", rows, rows * t.dim * FLOAT32_BYTES, first))
        out.append(TablePlan(name, t.kind, t.num_embeddings, t.dim, t.init_std, t.mode, partition, tuple(parts)))
    return tuple(out)


def format_tables(tables: tuple[TablePlan, ...]) -> list[str]:
    """The ``tables:`` section of ``dtrain plan``'s text."""
    lines = ["tables (sparse, rows on the ps tasks):"] if tables else []
    for t in tables:
        lines.append(f"  {t.name}  {t.kind} {t.num_embeddings}x{t.dim}  {t.bytes} B  partition {t.partition}")
        for p in t.parts:
            lines.append(f"    part {p.part} -> {p.task}  {p.rows} rows  {p.bytes} B")
    return lines


def table_config(table: TablePlan, part: int, seed: int) -> dict[str, Any]:
    """What a ps task needs to build its part (plain data, sent through Dask)."""
    return {"name": table.name, "num_embeddings": table.num_embeddings, "dim": table.dim,
            "num_parts": len(table.parts), "part": part, "strategy": table.partition, "init_std": table.init_std,
            "seed": seed}


def table_layout(tables: tuple[TablePlan, ...]) -> list[dict[str, Any]]:
    """What a checkpoint records of each table's partition (so a resume can repartition it)."""
    return [{"name": t.name, "num_embeddings": t.num_embeddings, "dim": t.dim, "partition": t.partition,
             "parts": len(t.parts)} for t in tables]


def reshard_table(parts: list[dict[str, Any]], num_embeddings: int, old: tuple[int, str],
                  new: tuple[int, str]) -> list[dict[str, Any]]:
    """A table's part states (``weight`` and per-row optimizer tensors, ``step``) written under the
    partition ``old`` = (parts, mod|div) -> the part states of ``new``: every row and its optimizer
    state moved to the part that holds its id now (the table is assembled once, here)."""
    from dtrain.model.tables import global_rows

    def ids(count: int, strategy: str, part: int) -> torch.Tensor:
        r = global_rows(num_embeddings, count, part, strategy)
        return torch.arange(r.start, r.stop, r.step)

    def regroup(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        full = torch.empty((num_embeddings, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
        for p, t in enumerate(tensors):
            full[ids(*old, p)] = t
        return [full[ids(*new, p)].clone() for p in range(new[0])]

    if len(parts) != old[0]:
        raise ValueError(f"{len(parts)} part state(s) for a partition of {old[0]}")
    weights = regroup([p["weight"] for p in parts])
    opt = [dict(p.get("optimizer") or {}) for p in parts]
    rowwise = [k for k, v in opt[0].items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    regrouped = {k: regroup([o[k] for o in opt]) for k in rowwise}
    scalars = {k: v for k, v in opt[0].items() if k not in rowwise}
    return [{"weight": weights[i], "optimizer": {**scalars, **{k: regrouped[k][i] for k in rowwise}}}
            for i in range(new[0])]
