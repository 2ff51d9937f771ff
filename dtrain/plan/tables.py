"""Where sparse embedding tables live: each table partitioned by rows over the ps tasks
(``placement.embedding_partition``: TensorFlow's ``mod`` and ``div``). Pure: nothing allocated.

A table never joins a shard's flat dense buffer: each ps task holds its part as its own (rows,
dim) tensor with per-row optimizer state (``dtrain.ps.rows``), and replicas move only the rows a
batch touches (docs/sparse.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
