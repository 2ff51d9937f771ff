"""The chief's side of the sparse tables on the ps tasks: restoring each table's parts from a
checkpoint (repartitioned onto another ps count or partition, converted to another storage
dtype), reading a part in chunks, gathering rows by id, the whole table for ``model.pt``, and the
tables' figures for ``summary.json``. Functions of the shard actors' handles and the plan
(``dtrain.chief.ps_shards.ShardGroup`` passes its current ones)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dtrain.chief.checkpoint import Checkpoint
from dtrain.errors import RunError
from dtrain.model.ids import home_part
from dtrain.model.tables import div_starts
from dtrain.plan.compiler import Plan
from dtrain.plan.tables import merge_dynamic, reshard_table, restore_problem, to_storage
from dtrain.ps.rows import unpack_state

from .calls import call, calls, transfer_timeout

logger = logging.getLogger(__name__)

TABLE_CHUNK_ROWS = 1 << 18  # rows of a table part a snapshot reads per call (32 MiB at dim 32)


def written_tables(plan: Plan, checkpoint: Checkpoint, written: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What the checkpoint records of each of the plan's tables (``table_layout``), once each can
    be restored into the pipeline's (RunError saying why one cannot: another size, another row
    optimizer, with against without a vocabulary)."""
    recorded = {t["name"]: t for t in written.get("tables") or ()}
    run_optimizer = ((checkpoint.payload.get("spec") or {}).get("optimizer") or {}).get("name")
    out = {}
    for table in plan.tables:
        was = recorded.get(table.name)
        why = (f"no such table for {table.name} (the pipeline's is {table.num_embeddings}x{table.dim})"
               if was is None else restore_problem(was, table, run_optimizer))
        if why:
            raise RunError(f"{checkpoint.path} holds {why}; use another --run-dir")
        if bool(was.get("dynamic")) != (table.dynamic is not None):
            raise RunError(f"{checkpoint.path} holds {table.name} as a table "
                           f"{'without' if was.get('dynamic') else 'with'} a vocabulary, the pipeline's is "
                           f"{'with' if was.get('dynamic') else 'without'} one; use another --run-dir")
        out[table.name] = was
    return out


def reshard_recipes(plan: Plan, recorded: dict[str, dict[str, Any]], chains: list[list[tuple[str, int, str]]]
                    ) -> dict[int, list[dict[str, Any]]]:
    """Per shard of the plan, what its ps task needs to restore its table parts itself from a
    checkpoint of parts written under another partition (``ParameterShard.load_resharded``):
    per table its sizes, the old and new partitions, its part, and every old part's chain of files
    (``chains[k]``: old shard ``k``'s, which held part ``k`` of each table)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for table in plan.tables:
        was = recorded[table.name]
        old = [int(was["parts"]), str(was["partition"])]
        for p in table.parts:
            out.setdefault(p.shard, []).append({
                "name": table.name, "num_embeddings": None if table.dynamic is not None else table.num_embeddings,
                "old": old, "new": [len(table.parts), table.partition], "part": p.part, "chains": chains[:old[0]]})
    return out


def restore_tables(plan: Plan, checkpoint: Checkpoint, states: list[dict[str, Any]],
                   written: dict[str, Any]) -> list[dict[str, Any]]:
    """Each table's part states from the checkpoint, repartitioned when it was written by
    another number of ps tasks or another ``embedding_partition`` (assembled here: a checkpoint
    of the single-file format)."""
    if not plan.tables:
        return states
    recorded = written_tables(plan, checkpoint, written)
    source = list(checkpoint.payload["shards"])  # the states as written: one part per old shard
    out = [dict(st) for st in states]
    for table in plan.tables:
        was = recorded[table.name]
        old = (int(was["parts"]), str(was["partition"]))
        new = (len(table.parts), table.partition)
        parts = [st["tables"][table.name] for st in source[:old[0]]]
        if table.dynamic is not None:
            if old[0] != new[0]:  # every new part takes, from all the rows, those whose id lives there
                merged = merge_dynamic(parts)  # (the counters once, on the first part: they are summed)
                parts = [merged] + [{**merged, "counters": {}}] * (new[0] - 1)
        elif old != new:
            logger.info("%s: repartitioning table %s from %d %s part(s) onto %d %s", checkpoint.path.name,
                        table.name, old[0], old[1], new[0], new[1])
            parts = reshard_table(parts, table.num_embeddings, old, new)
        if was.get("storage", "float32") != table.storage:  # converted, rounded to nearest
            logger.info("%s: converting table %s from %s to %s", checkpoint.path.name, table.name,
                        was.get("storage", "float32"), table.storage)
            parts = to_storage(parts, table.storage)
        for p in table.parts:
            out[p.shard] = {**out[p.shard], "tables": {**(out[p.shard].get("tables") or {}),
                                                        table.name: parts[p.part]}}
    return out


def gather_rows(handles: list[Any], plan: Plan, name: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows of table ``name`` for global ``ids`` (any order), from the ps tasks holding them."""
    table = next(t for t in plan.tables if t.name == name)
    if table.partition == "hash":
        part = home_part(ids, len(table.parts))
    else:
        part = ids % len(table.parts) if table.partition == "mod" else torch.searchsorted(
            torch.tensor(div_starts(table.num_embeddings, len(table.parts))[1:-1]), ids, right=True)
    out = torch.empty((len(ids), table.dim), dtype=torch.float32)
    for p in range(len(table.parts)):
        sel = torch.nonzero(part == p).flatten()
        if len(sel):
            out[sel] = call(handles[p].gather_rows(name, ids[sel]), timeout=transfer_timeout(len(sel) * table.dim))
    return out

def table_stats(handles: list[Any], plan: Plan, timeout: float = 10) -> dict[str, dict[str, Any]]:
    """summary.json's ``tables``: per table its rows, bytes and (no vocabulary) admitted, evicted
    and rejected, summed over the ps tasks, with each task's own figures under ``parts``."""
    out: dict[str, dict[str, Any]] = {}
    holders = sorted({p.shard for t in plan.tables for p in t.parts})
    futures = calls([handles[j] for j in holders], "table_stats")
    for j, future in zip(holders, futures, strict=True):
        for name, figures in call(future, timeout=timeout).items():
            entry = out.setdefault(name.removeprefix("tables.").removesuffix(".weight"), {"parts": {}})
            for key, value in figures.items():
                entry[key] = entry.get(key, 0) + value
            entry["parts"][plan.shards[j].task] = figures
    return out

def pull_rows(handles: list[Any], plan: Plan, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A table without a vocabulary, whole (for ``model.pt``): its ids, sorted, and their float32
    rows, read part by part in chunks."""
    table = next(t for t in plan.tables if t.name == name)
    got = [read_part(handles, table, part) for part in table.parts]
    ids = torch.cat([g["ids"] for g in got])
    rows = torch.cat([g["weight"].to(torch.float32) for g in got])
    order = torch.argsort(ids)
    return ids[order], rows[order]

def pull_table(handles: list[Any], plan: Plan, name: str, chunk_rows: int = 1 << 20) -> torch.Tensor:
    """The whole table ``name`` (for ``model.pt``), fetched in chunks of rows."""
    table = next(t for t in plan.tables if t.name == name)
    out = torch.empty((table.num_embeddings, table.dim), dtype=torch.float32)
    for lo in range(0, table.num_embeddings, chunk_rows):
        ids = torch.arange(lo, min(lo + chunk_rows, table.num_embeddings))
        out[lo:lo + len(ids)] = gather_rows(handles, plan, name, ids)
    return out


def read_part(handles: list[Any], table: Any, part: Any) -> dict[str, Any]:
    """One ps task's part of a table and its optimizer state, read in chunks of rows into
    tensors allocated here once (the ps copies one chunk at a time, never its whole part)."""
    handle, chunk_rows = handles[part.shard], TABLE_CHUNK_ROWS
    if table.dynamic is not None:  # its live rows, chunk by chunk of slots, with their ids
        chunks = [unpack_state(call(handle.read_part(table.name, lo, lo + chunk_rows),
                                    timeout=transfer_timeout(chunk_rows * table.dim)))
                  for lo in range(0, max(part.rows, 1), chunk_rows)]
        return {**chunks[-1], **{k: torch.cat([c[k] for c in chunks]) for k in ("ids", "weight", "last", "freq")},
                "optimizer": {k: torch.cat([c["optimizer"][k] for c in chunks]) if isinstance(v, torch.Tensor)
                              else v for k, v in chunks[-1]["optimizer"].items()}}
    out: dict[str, Any] = {}
    for lo in range(0, max(part.rows, 1), chunk_rows):
        hi = min(lo + chunk_rows, part.rows)
        got = unpack_state(call(handle.read_part(table.name, lo, hi),
                                timeout=transfer_timeout((hi - lo) * table.dim)))
        if not out:
            out = {"weight": torch.empty((part.rows, table.dim), dtype=got["weight"].dtype), "optimizer": {
                k: torch.empty((part.rows, *v.shape[1:]), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                for k, v in got["optimizer"].items()}}
        out["weight"][lo:hi] = got["weight"]
        for k, v in got["optimizer"].items():
            if isinstance(v, torch.Tensor):
                out["optimizer"][k][lo:hi] = v
    return out

