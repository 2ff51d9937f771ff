"""Where sparse embedding tables live: each table partitioned by rows over the ps tasks
(``placement.embedding_partition``: TensorFlow's ``mod`` and ``div``). Pure: nothing allocated.

A table never joins a shard's flat dense buffer: each ps task holds its part as its own (rows,
dim) tensor with per-row optimizer state (``dtrain.ps.rows``), and replicas move only the rows a
batch touches (docs/sparse.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.model.tables import div_starts

FLOAT32_BYTES = 4
STORAGE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""A table's storage dtypes (``dtrain.ps.rows.STORAGE``) and their bytes per element."""

# The row optimizers (dtrain.ps.row_optimizers: the plan cannot import the ps) and the keys a
# table's own optimizer config may hold; tests/plan/test_tables.py checks both against the ps.
ROW_OPTIMIZER_KEYS = {
    "sgd": ("lr", "weight_decay"),
    "adagrad": ("lr", "lr_decay", "initial_accumulator_value", "eps", "weight_decay"),
    "rowwise_adagrad": ("lr", "eps", "weight_decay"),
    "adam": ("lr", "betas", "eps"),
}


DYNAMIC_ROW_BYTES = 3 * 8 + 4 * 16
"""What a table without a vocabulary keeps per row besides the row and its optimizer state
(``dtrain.ps.dynamic``): its id, last use and use count (int64 each), and its share of the id
index (a key and a slot, 16 bytes, at up to 4 index positions per row between rebuilds)."""


def sketch_bytes(rows: int, min_count: int) -> int:
    """The admission sketch of a part of ``rows`` rows (``dtrain.ps.dynamic.CountMinSketch``): 2 rows
    of int32 counters, the next power of two from 4 x rows (at least 1024); none for min_count 1."""
    if min_count <= 1:
        return 0
    width = 1 << max(10, math.ceil(math.log2(max(4 * rows, 1))))
    return 2 * width * 4


def row_state_bytes(optimizer: str, rows: int, dim: int) -> int:
    """Bytes of float32 optimizer state ``optimizer`` keeps for ``rows`` rows of ``dim``: sgd none,
    adagrad one per element, rowwise_adagrad one per row, adam two per element."""
    per_row = {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[optimizer]
    return rows * per_row * FLOAT32_BYTES


@dataclass(frozen=True)
class TablePartPlan:
    """One ps task's rows of a table."""

    part: int  # the part's index (== the ps task's index)
    shard: int  # index into Plan.shards
    task: str  # "/job:ps/task:1"
    rows: int
    bytes: int  # the rows in the table's storage dtype plus their optimizer state (state_bytes)
    first: int  # div: its first global id; mod: its part index (ids first, first + P, ...)
    state_bytes: int = 0  # of ``bytes``: the row optimizer's state


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
    storage: str = "float32"  # the rows' dtype on the ps: float32 | bfloat16 | float16
    optimizer: Mapping[str, Any] | None = None  # the table's own optimizer config; None: the run's
    optimizer_name: str = "sgd"  # the row optimizer it gets: optimizer["name"], or the run's
    init: str = "chunked"  # chunked (model.layers, model.module tables) | per_id (model.tables)
    dynamic: Mapping[str, Any] | None = None  # no vocabulary: max_rows, min_count, ttl_steps, policy

    @property
    def rows(self) -> int:
        """Its rows: num_embeddings, or at most max_rows for a table without a vocabulary."""
        return sum(p.rows for p in self.parts) if self.dynamic is not None else self.num_embeddings

    @property
    def bytes(self) -> int:
        """The rows, in the storage dtype."""
        return self.rows * self.dim * STORAGE_BYTES[self.storage]

    @property
    def state_bytes(self) -> int:
        """The row optimizer's state (float32)."""
        return row_state_bytes(self.optimizer_name, self.rows, self.dim)


def table_optimizer_problem(config: Mapping[str, Any]) -> str | None:
    """Why a table's own optimizer config cannot be used (a message), or None."""
    name = config.get("name")
    if name not in ROW_OPTIMIZER_KEYS:
        return f"optimizer name {name!r} is not one of {', '.join(map(repr, ROW_OPTIMIZER_KEYS))}"
    keys = ROW_OPTIMIZER_KEYS[name]
    unknown = sorted(set(config) - {"name", *keys})
    if unknown:
        why = (" (torch.optim.SparseAdam has none; sgd, adagrad and rowwise_adagrad take it as L2 on touched rows)"
               if name == "adam" and "weight_decay" in unknown else "")
        return f"{name} takes {', '.join(keys)}, not {', '.join(unknown)}{why}"
    if "lr" not in config:
        return f"{name} needs lr"
    numbers = {k: v for k, v in config.items() if k not in ("name", "betas")}
    bad = [k for k, v in numbers.items() if not isinstance(v, (int, float)) or isinstance(v, bool)
           or not math.isfinite(v) or v < 0 or (k in ("lr", "eps") and v <= 0)]
    if bad:
        return f"{', '.join(f'{k} {numbers[k]!r}' for k in bad)}: lr and eps must be finite numbers > 0, the others >= 0"
    betas = config.get("betas", (0.9, 0.999))
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        return f"betas {betas!r}: two numbers in [0, 1)"
    return None


def plan_tables(tables: list[tuple[str, Any]], ps_job: str, num_ps: int, partition: str,
                run_optimizer: str = "sgd") -> tuple[TablePlan, ...]:
    """``tables``: (name, Table module, possibly on the meta device) pairs; ps task ``p`` is shard ``p``.
    ``run_optimizer``: the run's optimizer name (a table without its own config gets it). A
    table's storage or optimizer config that cannot be used: ValueError naming the table."""
    out = []
    for name, t in tables:
        storage = getattr(t, "storage", "float32")
        own = getattr(t, "optimizer", None)
        if storage not in STORAGE_BYTES:
            raise ValueError(f"table {name}: storage {storage!r} is not one of {', '.join(map(repr, STORAGE_BYTES))}")
        if own is not None and (why := table_optimizer_problem(own)):
            raise ValueError(f"table {name}: its optimizer {dict(own)}: {why}")
        opt = own["name"] if own is not None else run_optimizer
        if opt not in ROW_OPTIMIZER_KEYS:
            raise ValueError(f"table {name} gets the run's optimizer {opt!r}, which does not apply to sparse tables "
                             f"({', '.join(ROW_OPTIMIZER_KEYS)}): give the table its own optimizer")
        dynamic = getattr(t, "dynamic", None)
        starts = div_starts(t.num_embeddings, num_ps)
        parts = []
        for p in range(num_ps):
            if dynamic is not None:  # ids spread by a hash: each part holds at most its share of max_rows
                rows, first = -(-int(dynamic["max_rows"]) // num_ps), p
            elif partition == "div":
                rows, first = starts[p + 1] - starts[p], starts[p]
            else:
                rows, first = len(range(p, t.num_embeddings, num_ps)), p
            state = row_state_bytes(opt, rows, t.dim)
            index = 0 if dynamic is None else (rows * DYNAMIC_ROW_BYTES
                                               + sketch_bytes(rows, int(dynamic.get("min_count", 1))))
            parts.append(TablePartPlan(p, p, f"/job:{ps_job}/task:{p}", rows,
                                       rows * t.dim * STORAGE_BYTES[storage] + state + index, first, state))
        out.append(TablePlan(name, t.kind, t.num_embeddings, t.dim, t.init_std, t.mode,
                             "hash" if dynamic is not None else partition, tuple(parts), storage,
                             dict(own) if own is not None else None, opt, getattr(t, "init", "chunked"),
                             dict(dynamic) if dynamic is not None else None))
    return tuple(out)


def format_tables(tables: tuple[TablePlan, ...]) -> list[str]:
    """The ``tables:`` section of ``dtrain plan``'s text."""
    lines = ["tables (sparse, rows on the ps tasks):"] if tables else []
    for t in tables:
        size = f"{t.num_embeddings}x{t.dim}" if t.dynamic is None else f"<= {t.rows}x{t.dim} (no vocabulary)"
        lines.append(f"  {t.name}  {t.kind} {size}  {t.storage}  {t.optimizer_name}"
                     f"{'' if t.optimizer is None else ' (its own)'}  {t.bytes + t.state_bytes} B "
                     f"({t.bytes} B rows + {t.state_bytes} B state)  partition {t.partition}")
        for p in t.parts:
            lines.append(f"    part {p.part} -> {p.task}  {p.rows} rows  {p.bytes} B")
    return lines


def table_config(table: TablePlan, part: int, seed: int) -> dict[str, Any]:
    """What a ps task needs to build its part (plain data, sent through Dask): ``optimizer`` is the
    table's own config, or None for the run's."""
    return {"name": table.name, "num_embeddings": table.num_embeddings, "dim": table.dim,
            "num_parts": len(table.parts), "part": part, "strategy": table.partition, "init_std": table.init_std,
            "seed": seed, "storage": table.storage,
            "optimizer": dict(table.optimizer) if table.optimizer is not None else None, "init": table.init,
            **({"dynamic": dict(table.dynamic)} if table.dynamic is not None else {})}


def table_layout(tables: tuple[TablePlan, ...]) -> list[dict[str, Any]]:
    """What a checkpoint records of each table: its partition (so a resume can repartition it), its
    storage dtype and its row optimizer."""
    return [{"name": t.name, "num_embeddings": t.num_embeddings, "dim": t.dim, "partition": t.partition,
             "parts": len(t.parts), "storage": t.storage, "optimizer": t.optimizer_name, "init": t.init,
             "dynamic": t.dynamic is not None} for t in tables]


def restore_problem(written: Mapping[str, Any], table: TablePlan, default_optimizer: str | None = None) -> str | None:
    """Why a table recorded as ``written`` (:func:`table_layout`) cannot be restored into ``table``,
    or None. Another size or another row optimizer cannot be (the rows or their optimizer state
    do not fit); another storage dtype or partition can (:func:`reshard_table`, :func:`to_storage`).
    ``default_optimizer``: the row optimizer of a checkpoint that recorded none (written before
    tables had their own: the run's optimizer); None: not checked."""
    if (written["num_embeddings"], written["dim"]) != (table.num_embeddings, table.dim):
        return (f"a table of {written['num_embeddings']}x{written['dim']} for {table.name} (the pipeline's is "
                f"{table.num_embeddings}x{table.dim})")
    was = written.get("optimizer", default_optimizer)
    if was is not None and was != table.optimizer_name:
        return (f"table {table.name} with row optimizer {was!r}, the pipeline gives it {table.optimizer_name!r}: its "
                f"optimizer state cannot be used; resume with {was}")
    return None


def to_storage(parts: list[dict[str, Any]], storage: str) -> list[dict[str, Any]]:
    """Part states with their rows converted to the storage dtype ``storage`` (rounded to nearest,
    part by part); the optimizer state is float32 whatever the storage."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[storage]
    return [{**p, "weight": p["weight"].to(dtype)} for p in parts]


def reshard_table(parts: list[dict[str, Any]], num_embeddings: int, old: tuple[int, str],
                  new: tuple[int, str]) -> list[dict[str, Any]]:
    """A table's part states (``weight``, per-row optimizer tensors and ``step``) written under the
    partition ``old`` = (parts, mod|div) -> the part states of ``new``: every row and its optimizer
    state moved to the part that holds its id now (the table is assembled once, here). A per-row
    tensor is any optimizer tensor whose first dimension is its part's row count (adagrad's (rows,
    dim) sums, rowwise_adagrad's (rows,) accumulator); every tensor keeps its dtype (a bfloat16
    table stays bfloat16)."""
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
    counts = [len(p["weight"]) for p in parts]
    rowwise = [k for k, v in opt[0].items() if isinstance(v, torch.Tensor) and v.dim() >= 1
               and all(isinstance(o.get(k), torch.Tensor) and o[k].dim() >= 1 and len(o[k]) == n
                       for o, n in zip(opt, counts, strict=True))]
    regrouped = {k: regroup([o[k] for o in opt]) for k in rowwise}
    scalars = {k: v for k, v in opt[0].items() if k not in rowwise}
    out = [{"weight": weights[i], "optimizer": {**scalars, **{k: regrouped[k][i] for k in rowwise}}}
           for i in range(new[0])]
    if all(p.get("fresh") is not None for p in parts):  # rows not drawn yet stay so, wherever they go
        for o, fresh in zip(out, regroup([p["fresh"] for p in parts]), strict=True):
            o["fresh"] = fresh
    return out


def merge_dynamic(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The part states of a table without a vocabulary, concatenated: each part of another ps count
    loads from it the rows whose ids live there (``dtrain.ps.dynamic``); counters add up."""
    tensors = ("ids", "weight", "last", "freq")
    opt = [dict(p.get("optimizer") or {}) for p in parts]
    counters: dict[str, int] = {}
    for p in parts:
        for key, value in (p.get("counters") or {}).items():
            counters[key] = counters.get(key, 0) + int(value)
    return {**{k: torch.cat([p[k] for p in parts]) for k in tensors},
            "optimizer": {k: torch.cat([o[k] for o in opt]) if isinstance(v, torch.Tensor) else v
                          for k, v in opt[0].items()},
            "clock": max(int(p.get("clock", 0)) for p in parts), "counters": counters}
