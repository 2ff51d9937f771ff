"""A replica's side of sparse embedding tables: which rows each step needs, from which ps task,
and the sparse gradient each task gets back (docs/sparse.md).

The replica's model holds its tables *gathered* (``dtrain.model.tables.Table``): no table, only
the current batch's unique ids and their rows. Each push carries, per ps task, the ids of the
rows this batch touched that the task holds, their summed row gradients, and the ids of the
*next* batch that the task holds; the reply brings those rows, after the update. So the rows
ride on the push's own round trip: a step costs no extra request, and the whole table never
crosses the wire. No Dask here.
"""

from __future__ import annotations

from collections import deque
from itertools import accumulate
from typing import Any

import torch

from dtrain.dataplane.rows import SparseBlock
from dtrain.model.ids import home_part
from dtrain.model.tables import Table, div_starts, tables_of
from dtrain.plan.tables import TablePlan


class TableRoute:
    """One table: its plan, its gathered module, and the routing of one batch's ids."""

    def __init__(self, plan: TablePlan, module: Table):
        self.plan = plan
        self.module = module
        self.num_parts = len(plan.parts)
        self._bounds = torch.tensor(div_starts(plan.num_embeddings, self.num_parts)[1:-1], dtype=torch.int64)

    def part_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The part (== ps task) holding each global id."""
        if self.plan.partition == "hash":  # a table without a vocabulary: dtrain.model.ids
            return home_part(ids, self.num_parts)
        if self.plan.partition == "mod":
            return ids % self.num_parts
        return torch.searchsorted(self._bounds, ids, right=True)

    def split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Positions in ``ids`` (sorted unique) of the ids each part holds."""
        part = self.part_of(ids)
        return [torch.nonzero(part == p).flatten() for p in range(self.num_parts)]


class Routed:
    """One batch's ids of every table, routed at once: ``ids`` per table (sorted unique, on the
    CPU) and side by side (``flat``, table after table); the blocks of (part, table) pairs,
    part-major, as positions into ``flat`` (``order`` split by ``sizes``), as ids (``sorted``:
    ``flat[order]``, ``blocks``: it split), and each part's run of them (``spans``)."""

    def __init__(self, ids: list[torch.Tensor], flat: torch.Tensor, part: torch.Tensor, table: torch.Tensor,
                 num_parts: int):
        self.ids, self.flat = ids, flat
        self.starts = [0, *accumulate(len(i) for i in ids)]  # each table's first position in flat
        # A part's positions, ascending, run table after table, each table's ids sorted (as the ps
        # expects them): a stable sort by (part, table) in one nonzero per part.
        self.order = torch.cat([torch.nonzero(part == p).flatten() for p in range(num_parts)])
        self.sizes = torch.bincount(part * len(ids) + table, minlength=num_parts * len(ids)).tolist()
        self.sorted = flat[self.order]
        self.blocks = self.sorted.split(self.sizes)
        per_part = [sum(self.sizes[p * len(ids):(p + 1) * len(ids)]) for p in range(num_parts)]
        self.spans = list(zip([0, *accumulate(per_part)], accumulate(per_part), strict=False))

    def split(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``values`` (one per id of ``flat``) as the blocks."""
        return values[self.order].split(self.sizes)

    def positions(self) -> list[tuple[int, torch.Tensor]]:
        """Per block: (its table, the positions of its ids in that table's ids)."""
        tables = len(self.ids)
        return [(b % tables, pos - self.starts[b % tables]) for b, pos in enumerate(self.order.split(self.sizes))]


class SparseRouter:
    """Routes a replica's tables' rows (see the module docstring). ``num_shards``: the plan's shards
    (the ps tasks come first: part ``p`` lives on shard ``p``). Every table's ids are routed in one
    pass (their parts computed side by side, sorted once by (part, table)); only the requests'
    entries and the installing of each table's rows are per table."""

    def __init__(self, model: torch.nn.Module, plans: tuple[TablePlan, ...], num_shards: int,
                 device: torch.device, record: bool = False):
        by_name = {t.name: t for t in plans}
        self.model, self.record = model, record  # record: a custom module (ids_of's record pass)
        self.routes = [TableRoute(by_name[name], module) for name, module in tables_of(model)]
        missing = set(by_name) - {r.plan.name for r in self.routes}
        if missing:
            raise ValueError(f"the plan's tables {sorted(missing)} are not in the replica's model")
        self.num_shards = num_shards
        self.device = device
        self.num_parts = max((r.num_parts for r in self.routes), default=1)
        self._parts = torch.tensor([r.num_parts for r in self.routes], dtype=torch.int64)
        kinds = {r.plan.partition for r in self.routes}
        self._kind = kinds.pop() if len(kinds) == 1 else None  # one partitioning for every table: one pass
        # div: each table's part bounds, a row per table (padded with bounds no id reaches)
        self._bounds = torch.full((len(self.routes), self.num_parts - 1), torch.iinfo(torch.int64).max)
        for t, r in enumerate(self.routes):
            self._bounds[t, :len(r._bounds)] = r._bounds
        self._one_width = len({r.plan.dim for r in self.routes}) == 1  # rows side by side in one tensor
        # Routed batches whose rows have not come yet: the next batch's (its rows come with the next
        # reply), and, routed while that reply is awaited, the one after it (off the step's path).
        self.pending: deque[Routed] = deque()
        self.current: Routed | None = None
        self.rows_moved = 0  # rows received, for the benchmark's bytes per step

    @property
    def active(self) -> bool:
        return bool(self.routes)

    @property
    def next(self) -> Routed | None:
        """The batch whose rows the next reply brings: the first routed one not yet taken (the
        current one again at the end of the data)."""
        return self.pending[0] if self.pending else self.current

    def plan_next(self, inputs: torch.Tensor) -> None:
        """Route the batch after the ones routed so far (:attr:`pending`): its ids per table, the
        model's input for a ``model.layers`` table (the first layer), what a record pass sees for a
        custom module's tables (:func:`ids_of`)."""
        seen = table_ids(self.model, inputs, self.record)
        ids = [seen[r.plan.name] for r in self.routes]
        counts = [len(i) for i in ids]
        flat = torch.cat(ids)
        table = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(counts))
        self.pending.append(Routed(ids, flat, self._part_of(flat, table, counts), table, self.num_parts))

    def _part_of(self, ids: torch.Tensor, table: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`TableRoute.part_of` of every table's ids side by side (``table``: each id's table)."""
        if self._kind == "mod":
            return torch.remainder(ids, self._parts[table])
        if self._kind == "div":
            return (ids.unsqueeze(1) >= self._bounds[table]).sum(1)
        return torch.cat([r.part_of(i) for r, i in zip(self.routes, ids.split(counts), strict=True)])

    def requests(self, with_grads: bool) -> list[SparseBlock | dict[str, tuple[Any, Any, Any]]]:
        """Per shard: its tables' (pushed ids, their row gradients, wanted ids of the next batch),
        as one :class:`~dtrain.dataplane.rows.SparseBlock` (every table's entries side by side:
        slices of the routed batches, no tensor per table) when the tables share one width, else
        as a mapping per table."""
        cur, nxt = self.current, self.next
        assert nxt is not None, "plan_next first"
        pushing = with_grads and cur is not None
        if self._one_width:
            out: list[SparseBlock | dict[str, tuple[Any, Any, Any]]] = [{} for _ in range(self.num_shards)]
            grads = self._flat_grads(cur) if pushing and cur is not None else None
            tables = len(self.routes)
            dim = self.routes[0].plan.dim
            for p in range(self.num_parts):
                members = [t for t, r in enumerate(self.routes) if p < r.num_parts]
                names = [self.routes[t].plan.name for t in members]
                want = [nxt.sizes[p * tables + t] for t in members]
                w0, w1 = nxt.spans[p]
                if grads is not None and cur is not None:
                    a, b = cur.spans[p]
                    push = [cur.sizes[p * tables + t] for t in members]
                    out[p] = SparseBlock(names, [dim] * len(names), push, want, cur.sorted[a:b],
                                         grads[a:b].reshape(-1), nxt.sorted[w0:w1])
                else:
                    out[p] = SparseBlock(names, [dim] * len(names), [0] * len(names), want,
                                         torch.empty(0, dtype=torch.int64), None, nxt.sorted[w0:w1])
            return out
        per_block = self._grads(cur) if pushing and cur is not None else None
        dicts: list[SparseBlock | dict[str, tuple[Any, Any, Any]]] = [{} for _ in range(self.num_shards)]
        for p in range(self.num_parts):
            for t, route in enumerate(self.routes):
                if p < route.num_parts:
                    b = p * len(self.routes) + t
                    entry = (cur.blocks[b], per_block[b]) if per_block is not None and cur is not None else (None, None)
                    dicts[p][route.plan.name] = (*entry, nxt.blocks[b])  # type: ignore[index]
        return dicts

    def _flat_grads(self, routed: Routed) -> torch.Tensor | None:
        """The current rows' gradients of every table side by side in the routed order (one width),
        or None when a table has none (no push at all)."""
        grads = [r.module.rows.grad if r.module.rows is not None else None for r in self.routes]
        if any(g is None for g in grads):
            return None
        return torch.cat(grads).detach().to("cpu")[routed.order]  # type: ignore[arg-type]

    def _grads(self, routed: Routed) -> list[torch.Tensor] | None:
        """The current rows' gradients per block (None when a table has none: no push at all)."""
        grads = [r.module.rows.grad if r.module.rows is not None else None for r in self.routes]
        if any(g is None for g in grads):
            return None
        return [grads[t].detach().to("cpu")[pos] for t, pos in routed.positions()]  # type: ignore[union-attr]

    def take(self, replies: list[tuple[Any, ...]]) -> None:
        """Install the next batch's rows from the replies (their fifth elements: a part's rows side
        by side in the request's order, or per table) and make it current."""
        nxt = self.next
        assert nxt is not None, "plan_next first"
        tables = len(self.routes)
        got: list[torch.Tensor | None] = []  # per block
        for p in range(self.num_parts):
            rows = replies[p][4] if len(replies[p]) > 4 else {}
            members = [t for t, r in enumerate(self.routes) if p < r.num_parts]
            if isinstance(rows, torch.Tensor):
                count = sum(nxt.sizes[p * tables + t] for t in members)
                if rows.shape[0] != count:
                    raise RuntimeError(f"ps shard {p} sent {rows.shape[0]} rows for {count} ids")
                blocks = iter(rows.split([nxt.sizes[p * tables + t] for t in members]))
                got.extend(next(blocks) if p < r.num_parts else None for r in self.routes)
                continue
            for route in self.routes:
                block = rows.get(route.plan.name) if p < route.num_parts else None
                if block is None and p < route.num_parts:
                    raise RuntimeError(f"ps shard {p} sent no rows of table {route.plan.name} (stopped or failed)")
                got.append(block)
        if self._one_width:
            rows = torch.empty((len(nxt.flat), self.routes[0].plan.dim), dtype=torch.float32)
            rows[nxt.order] = torch.cat([g for g in got if g is not None])
            per_table = list(rows.split([len(i) for i in nxt.ids]))
        else:
            per_table = [torch.empty((len(i), r.plan.dim), dtype=torch.float32)
                         for i, r in zip(nxt.ids, self.routes, strict=True)]
            for (t, pos), g in zip(nxt.positions(), got, strict=True):
                if g is not None:
                    per_table[t][pos] = g
        for route, ids, rows in zip(self.routes, nxt.ids, per_table, strict=True):
            route.module.gather(ids.to(self.device), rows.to(self.device))
        self.rows_moved += len(nxt.flat)
        if self.pending:
            self.pending.popleft()
        self.current = nxt


def table_ids(model: torch.nn.Module, inputs: torch.Tensor, record: bool) -> dict[str, torch.Tensor]:
    """The sorted unique ids (on the CPU) each table of ``model`` needs for ``inputs``: what the
    model reads from its records for a recommendation model (its ``table_ids``), the inputs
    themselves for a ``model.layers`` table (the first layer), a record pass for a custom
    module's (``record``: :func:`ids_of`)."""
    own = getattr(model, "table_ids", None)
    if callable(own):
        return own(inputs)
    if record:
        return ids_of(model, inputs)
    ids = torch.unique(inputs.detach().to("cpu", torch.int64))
    return {name: ids for name, _ in tables_of(model)}


@torch.no_grad()
def ids_of(model: torch.nn.Module, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sorted unique ids each table of ``model`` looks up for ``inputs``: a record pass, the
    model's forward in eval mode with every table answering zeros and noting its ids (for a
    custom module, whose ids are its own computation). A module whose ids depend on a table's
    output is not supported: its lookups then fail, naming the table."""
    tables = tables_of(model)
    was_training = model.training
    for _, t in tables:
        t.recording = []
    try:
        model.eval()  # no dropout draws, no batch-norm statistics: the step's own pass is untouched
        model(inputs)
        return {name: torch.unique(torch.cat(t.recording).cpu()) if t.recording else
                torch.empty(0, dtype=torch.int64) for name, t in tables}
    finally:
        model.train(was_training)
        for _, t in tables:
            t.recording = None


@torch.no_grad()
def evaluate_gathered(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_name: str,
                      gather: Any, batch_size: int = 1024, record: bool = False, auc: Any = None
                      ) -> dict[str, float]:
    """Like ``dtrain.worker.replica.evaluate`` for a model with gathered tables: each batch's rows
    come from ``gather(table name, unique ids)`` (the ps), so only the touched rows move."""
    from dtrain.model.layers import accuracy, get_loss, is_classification

    if len(x) == 0:
        return {}
    was_training = model.training
    model.eval()
    loss_fn = get_loss(loss_name)
    total, correct = 0.0, 0.0
    try:
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            wanted = table_ids(model, xb, record)
            for name, table in tables_of(model):
                table.gather(wanted[name], gather(name, wanted[name]))
            out = model(xb)
            total += float(loss_fn(out, yb)) * len(yb)
            if is_classification(loss_name):
                correct += accuracy(out, yb, loss_name) * len(yb)
            if auc is not None:  # a dtrain.model.metrics.AucHistogram
                auc.add(out, yb)
    finally:
        model.train(was_training)
    result = {"loss": total / len(x)}
    if is_classification(loss_name):
        result["accuracy"] = correct / len(x)
    return result

