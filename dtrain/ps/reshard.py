"""A ps task's table parts restored from a checkpoint written under another partition (another
number of ps tasks, or ``mod`` against ``div``), on the task itself: nothing passes through the
chief.

Each old part's chain (its full part, then the deltas after it: ``dtrain.ps.deltas``) is read
memory-mapped, and from each file only the rows this task owns now are taken and laid over its own
part as deltas (``TablePart.load_delta``, ``DynamicTablePart.load_delta``): a table with a
vocabulary a block of old rows at a time (which of them are this task's follows from the two
partitions: :func:`owned`); a table without one, the rows whose ids hash here. Rows an old part
had not drawn yet (``init: per_id``) stay undrawn here. The new part's row optimizer step is the
old parts'; for a table without a vocabulary, its clock is the newest and its counters (admitted,
evicted, rejected) the sum, kept by part 0 (as the chief's merge of a format-1 checkpoint keeps
them). Pure torch: no Dask.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dtrain.model.tables import div_starts, global_rows

BLOCK_ROWS = 1 << 20  # old rows looked at per block: bounded temporaries whatever the table's size


def owned(num_embeddings: int, old: tuple[int, str], old_part: int, new: tuple[int, str], part: int,
          local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of old part ``old_part``'s rows ``local`` (local indices under the partition ``old`` =
    (parts, strategy)), the positions in ``local`` of those part ``part`` of ``new`` holds, and
    their local indices there."""
    r = global_rows(num_embeddings, old[0], old_part, old[1])
    ids = local.to(torch.int64) * r.step + r.start
    if new[1] == "mod":
        mine = ids % new[0] == part
        where = torch.nonzero(mine).flatten()
        return where, ids[where] // new[0]
    starts = div_starts(num_embeddings, new[0])
    mine = (ids >= starts[part]) & (ids < starts[part + 1])
    where = torch.nonzero(mine).flatten()
    return where, ids[where] - starts[part]


def fixed_deltas(state: dict[str, Any], num_embeddings: int, old: tuple[int, str], old_part: int,
                 new: tuple[int, str], part: int) -> Iterator[dict[str, Any]]:
    """One old part's table state (full or delta) as deltas of the new part ``part``: the rows it
    owns, a block at a time (at least one, maybe empty, so the optimizer's step count comes too)."""
    opt = dict(state.get("optimizer") or {})
    per_row = {k: v for k, v in opt.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
    scalars = {k: v for k, v in opt.items() if k not in per_row}
    blocks: list[tuple[torch.Tensor, torch.Tensor | None]]
    if state.get("delta"):
        rows = state["rows"].to(torch.int64)
        blocks = [(rows, torch.arange(len(rows)))]
    else:
        n = len(state["weight"])
        blocks = [(torch.arange(lo, min(lo + BLOCK_ROWS, n)), None) for lo in range(0, max(n, 1), BLOCK_ROWS)]
    fresh = state.get("fresh")
    for local, at in blocks:
        where, mine = owned(num_embeddings, old, old_part, new, part, local)
        src = local[where] if at is None else at[where]  # (rows of the state's tensors to take)
        if fresh is not None and at is None:  # (undrawn rows stay undrawn here)
            drawn = ~fresh.index_select(0, src)
            src, mine = src[drawn], mine[drawn]
        yield {"delta": True, "rows": mine, "weight": state["weight"].index_select(0, src),
               "optimizer": {**scalars, **{k: v.index_select(0, src) for k, v in per_row.items()}}}


def dynamic_delta(state: dict[str, Any]) -> dict[str, Any]:
    """One old part's state of a table without a vocabulary as a delta (a full part's live slots;
    a delta as it is): ``DynamicTablePart.load_delta`` keeps the rows whose ids hash to its part."""
    if state.get("delta"):
        return state
    live = state["ids"].to(torch.int64) >= 0
    opt = dict(state.get("optimizer") or {})
    return {"delta": True, "ids": state["ids"][live], "weight": state["weight"][live], "last": state["last"][live],
            "freq": state["freq"][live], "evicted": torch.zeros(0, dtype=torch.int64),
            "optimizer": {k: v[live] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v for k, v in opt.items()},
            "clock": state.get("clock", 0), "counters": state.get("counters") or {}}


def restore_part(part: Any, chains: list[list[dict[str, Any]]], num_embeddings: int | None, old: tuple[int, str],
                 new: tuple[int, str], index: int) -> None:
    """Lay every old part's chain (``chains[k]``: the table's states in part ``k``'s files, full
    first) over ``part``, this task's part ``index`` of the table (module docstring)."""
    dynamic = num_embeddings is None
    clock, counters = 0, {"admitted": 0, "evicted": 0, "rejected": 0}
    for k, chain in enumerate(chains):
        for state in chain:
            if num_embeddings is None:
                part.load_delta(dynamic_delta(state))
            else:
                for delta in fixed_deltas(state, num_embeddings, old, k, new, index):
                    part.load_delta(delta)
        if dynamic and chain:
            clock = max(clock, int(chain[-1].get("clock", 0)))
            for key, value in (chain[-1].get("counters") or {}).items():
                counters[key] = counters.get(key, 0) + int(value)
    if dynamic:
        part.clock = clock
        part.counters = counters if index == 0 else {key: 0 for key in counters}
