"""Incremental checkpoint parts: a ps task's part that holds, for each table, only the rows written
since the checkpoint before (``checkpoint.incremental``), and how it is laid over the part it
follows.

A *delta* part is a full part's dense state (parameters, optimizer state, step, counters: small,
always whole) with, per table, ``{"delta": True, ...}``:

- a table with a vocabulary: ``rows`` (local indices, sorted), their ``weight`` and per-row
  optimizer state (``TablePart.delta_state``);
- a table without one: the live rows written since (``ids``, ``weight``, ``last``, ``freq``, per-row
  optimizer state), the ids ``evicted`` since, ``clock`` and ``counters``
  (``DynamicTablePart.delta_state``).

A ps task restoring its own part applies each delta to its live tables (``load_delta``); the
functions here merge a delta into a part *state* instead, for a restore that reads parts in the
chief (another placement) and for ``dtrain export``. Pure torch: no Dask.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_delta", "merge"]


def is_delta(state: dict[str, Any]) -> bool:
    """Whether a part state holds a delta of some table."""
    return any(isinstance(t, dict) and t.get("delta") for t in (state.get("tables") or {}).values())


def merge(state: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a full part, or one merged already) with ``delta`` (the next part of its chain)
    laid over it: the dense state is the delta's, each table's rows are the state's with the
    delta's written over them. Tensors of ``state`` are never written (they may be memory-mapped
    from a read-only file): a changed one is copied first."""
    tables = dict(state.get("tables") or {})
    for name, change in (delta.get("tables") or {}).items():
        if name not in tables:
            raise ValueError(f"a delta for table {name!r}, which the part it follows does not hold")
        if not change.get("delta"):
            tables[name] = change
        elif "ids" in change:
            tables[name] = _merge_dynamic(tables[name], change)
        else:
            tables[name] = _merge_fixed(tables[name], change)
    return {**{k: v for k, v in delta.items() if k != "tables"}, **({"tables": tables} if tables else {})}


def _merge_fixed(state: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    rows = change["rows"].to(torch.int64)
    weight = state["weight"].clone()
    weight.index_copy_(0, rows, change["weight"].to(weight.dtype))
    opt = dict(state.get("optimizer") or {})
    for key, value in (change.get("optimizer") or {}).items():
        if isinstance(value, torch.Tensor) and isinstance(opt.get(key), torch.Tensor):
            opt[key] = opt[key].clone().index_copy_(0, rows, value.to(opt[key].dtype))
        else:
            opt[key] = value
    out = {**state, "weight": weight, "optimizer": opt}
    if state.get("fresh") is not None:  # (a delta's rows were all drawn: written, or read once)
        out["fresh"] = state["fresh"].clone().index_fill_(0, rows, False)
    return out


def _merge_dynamic(state: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """A dynamic part's slots (``live_state``: free slots have id -1) with the evicted ids freed and
    the delta's rows written where their ids are, or appended."""
    ids = state["ids"].to(torch.int64).clone()
    if len(change["evicted"]):
        ids[torch.isin(ids, change["evicted"].to(torch.int64))] = -1
    new_ids = change["ids"].to(torch.int64)
    order = torch.argsort(ids)
    where = torch.searchsorted(ids[order], new_ids).clamp(max=max(len(ids) - 1, 0))
    found = (ids[order][where] == new_ids) if len(ids) else torch.zeros(len(new_ids), dtype=torch.bool)
    slot = torch.where(found, order[where] if len(ids) else where, -1)
    fresh = torch.nonzero(~found).flatten()
    slot[fresh] = len(ids) + torch.arange(len(fresh))
    grow = len(fresh)

    def laid(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        out = torch.cat([old, torch.zeros((grow, *old.shape[1:]), dtype=old.dtype)]) if grow else old.clone()
        out[slot] = new.to(out.dtype)
        return out

    opt = dict(state.get("optimizer") or {})
    for key, value in (change.get("optimizer") or {}).items():
        opt[key] = laid(opt[key], value) if isinstance(value, torch.Tensor) and key in opt else value
    return {**state, "ids": laid(ids, new_ids), "weight": laid(state["weight"], change["weight"]),
            "last": laid(state["last"].to(torch.int64), change["last"]),
            "freq": laid(state["freq"].to(torch.int64), change["freq"]), "optimizer": opt,
            "clock": change.get("clock", state.get("clock", 0)), "counters": change.get("counters", state.get("counters"))}
