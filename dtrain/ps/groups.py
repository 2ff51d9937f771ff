"""One ps task's table parts batched: the parts that agree on (dim, storage dtype, row optimizer
config, partition), their rows in one tensor and their optimizer state likewise (FBGEMM's
table-batched embeddings, on the ps).

A request names up to one entry per table (a DLRM has tens of tables), and the per-table path
(``dtrain.ps.rows.TablePart``) runs a dozen small torch calls per table per request and twenty
more per table per apply: on small tables the calls' overhead is the ps's CPU, not the rows. A
:class:`TableGroup` holds its parts' rows at offsets of one (rows, dim) tensor (``starts``) and
makes one call where the parts made one each: one pass per request that checks every id and finds
its row (read again by the add and the gather), one ``index_select`` for the rows it asks for; per
step one unique, one ``index_add_``, one optimizer update and one write-back for all the group's
tables.

Each part stays a :class:`~dtrain.ps.rows.TablePart` whose rows and optimizer state are views
into the group's (so ``check_ids``, ``gather``, ``state``, ``chunk``, ``load_state`` and the
per-table ``add_grad``/``apply`` work as before, and a checkpoint holds the same per-table states),
with its own step count and stochastic-rounding stream. The results are those of the per-table
path, bit for bit: a row's gradients are summed in the order they came, the row optimizers are
row-wise (each row's update reads only its own state), and a bfloat16 or float16 write-back
rounds each table's rows with that table's own stream, as its part would. The step counts of a
group's parts agree (they step together); where a restored state made them differ, the optimizer
steps part by part (over the group's gathered rows) until the shard is restored again.

Tables without a vocabulary (``DynamicTablePart``) and a group of one stay per table.

Pure torch: no Dask.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from dtrain.model.tables import global_rows

from .dynamic import DynamicTablePart
from .rows import (
    STORAGE,
    ChangeMarks,
    TablePart,
    _stream_seed,
    make_row_optimizer,
    round_stochastic,
    sum_rows,
)

__all__ = ["TableGroup", "table_part", "table_parts"]


def _key(config: dict[str, Any], optimizer: dict[str, Any]) -> tuple[Any, ...]:
    """What the parts of one group share."""
    return (int(config["dim"]), config.get("storage", "float32"), json.dumps(optimizer, sort_keys=True, default=str),
            int(config["num_parts"]), int(config["part"]), config["strategy"])


class TableGroup:
    """The parts of ``configs`` (plan configs, ``dtrain.plan.tables.table_config``, agreeing on
    :func:`_key`) in shared buffers, and their batched per-step work (module docstring).

    Requests address tables by their index in the group (``members``), with one id tensor each
    (global ids; empty tensors left out by the caller)."""

    def __init__(self, configs: list[dict[str, Any]], optimizer_config: dict[str, Any], track: bool = False):
        first = configs[0]
        self.dim, self.storage = int(first["dim"]), first.get("storage", "float32")
        self.num_parts, self.part, self.strategy = int(first["num_parts"]), int(first["part"]), first["strategy"]
        self.names = [c["name"] for c in configs]
        spans = [global_rows(int(c["num_embeddings"]), self.num_parts, self.part, self.strategy) for c in configs]
        self.starts = [0]
        for r in spans:
            self.starts.append(self.starts[-1] + len(r))
        total = self.starts[-1]
        self.weight = torch.empty((total, self.dim), dtype=STORAGE[self.storage])
        self.optimizer = make_row_optimizer(total, self.dim, optimizer_config)  # (its initial state, every row)
        state = self.optimizer.tensors()
        # The rows not drawn yet (a per_id member's, drawn on first use: TablePart.ensure); the
        # other members' are drawn at construction.
        self.fresh = torch.tensor([c.get("init") == "per_id" for c in configs]).repeat_interleave(
            torch.tensor([len(r) for r in spans]), output_size=total)
        # The rows written since the last checkpoint's snapshot (incremental checkpoints): the
        # members mark their views of it, and so does the group's own apply.
        self.marks = ChangeMarks(total) if track else None
        self.parts: list[TablePart] = []
        for c, lo, hi in zip(configs, self.starts, self.starts[1:], strict=False):
            settings = {k: v for k, v in c.items() if k not in ("optimizer", "dynamic")}
            views = (self.weight[lo:hi], {k: t[lo:hi] for k, t in state.items()})
            self.parts.append(TablePart(**settings, optimizer_config=optimizer_config, buffers=views,
                                        fresh=self.fresh[lo:hi],
                                        marks=(self.marks, lo) if self.marks is not None else None))
        # Global id -> group row: id // num_parts (mod) or id (div), plus ``shift``; a member's rows
        # are [starts[m], starts[m + 1]) of the group, its ids [lo, hi) (mod: and id % num_parts == part).
        shift = [lo if self.strategy == "mod" else lo - r.start for lo, r in zip(self.starts, spans, strict=False)]
        self._shift = torch.tensor(shift, dtype=torch.int64)
        # checked_rows: each member's first and past-last group row (its rows hold exactly its ids on
        # this part), and the id -> quotient step as a shift where num_parts is a power of two
        self._first = torch.tensor(self.starts[:-1], dtype=torch.int64)
        self._end = torch.tensor(self.starts[1:], dtype=torch.int64)
        p = self.num_parts
        self._bits = p.bit_length() - 1 if self.strategy == "mod" and p & (p - 1) == 0 else None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (group rows, float32 row gradients)

    def _flat(self, members: list[int], ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the global ids side by side as int64, the member of each)."""
        flat = (torch.cat(ids) if len(ids) > 1 else ids[0]).to(torch.int64)
        lens = torch.tensor([t.shape[0] for t in ids])
        return flat, torch.tensor(members).repeat_interleave(lens, output_size=flat.shape[0])

    def _rows(self, members: list[int], ids: list[torch.Tensor]) -> torch.Tensor:
        """The group rows of ``ids`` (checked: :meth:`valid`), one tensor of ids per member."""
        return self.rows_of(*self._flat(members, ids))

    def rows_of(self, flat: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """The group rows of global ids ``flat`` (checked), ``which``: the member of each."""
        base = flat.div(self.num_parts, rounding_mode="floor") if self.strategy == "mod" else flat
        return base + self._shift.index_select(0, which)

    def checked_rows(self, flat: torch.Tensor, which: torch.Tensor) -> torch.Tensor | None:
        """:meth:`rows_of`, checked: the group rows of global ids ``flat`` (``which``: the member of
        each), or None when an id is outside its table or not on this part. A member's rows are exactly its ids on this part, so an id is valid when its row
        falls in its member's run of rows (and, mod, it leaves this part's remainder)."""
        if self.strategy == "mod":
            if self._bits is not None:  # (a power of two: shifts, no integer division)
                quotient, on_part = flat >> self._bits, (flat & (self.num_parts - 1)) == self.part
            else:
                quotient = flat.div(self.num_parts, rounding_mode="floor")
                on_part = (flat - quotient * self.num_parts) == self.part
            first = self._first.index_select(0, which)
            rows = quotient + first
            ok = on_part & (rows >= first)
        else:
            rows = flat + self._shift.index_select(0, which)
            ok = rows >= self._first.index_select(0, which)
        ok &= rows < self._end.index_select(0, which)
        return rows if bool(ok.all()) else None

    def valid(self, members: list[int], ids: list[torch.Tensor]) -> bool:
        """Whether every id is in its table and on this part (else the parts' ``check_ids`` say why)."""
        return not ids or self.valid_flat(*self._flat(members, ids))

    def valid_flat(self, flat: torch.Tensor, which: torch.Tensor) -> bool:
        """:meth:`valid` of global ids ``flat``, ``which``: the member of each (:meth:`checked_rows`)."""
        return self.checked_rows(flat, which) is not None

    def add_grad(self, members: list[int], ids: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Replica row gradients for this step (checked ids), as ``TablePart.add_grad`` per member."""
        if ids:
            grad = torch.cat(grads) if len(grads) > 1 else grads[0]
            self._pending.append((self._rows(members, ids), grad.to(torch.float32)))

    def add_rows(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Row gradients (rows x dim) of group ``rows`` (:meth:`rows_of`) for this step."""
        if rows.numel():
            self._pending.append((rows, grads.to(torch.float32)))

    def gather(self, members: list[int], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per member in ``members``, the float32 rows of its ``ids`` (checked), as ``TablePart.gather``
        (views into one tensor the group no longer holds)."""
        if not ids:
            return []
        rows = self.gather_rows(self._rows(members, ids))
        return list(rows.split([t.shape[0] for t in ids]))

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 values of group rows ``index`` (:meth:`rows_of`), drawn first where new."""
        self._ensure(index)
        return self.weight.index_select(0, index).to(torch.float32)

    def _ensure(self, rows: torch.Tensor) -> None:
        """Draw the group rows among ``rows`` that no member has drawn yet (TablePart.ensure)."""
        need = rows[self.fresh.index_select(0, rows)]
        if need.numel():
            unique = torch.unique(need)
            cuts = self._cuts(unique)
            for m, part in enumerate(self.parts):
                if cuts[m + 1] > cuts[m]:
                    part.ensure(unique[cuts[m]:cuts[m + 1]] - self.starts[m])

    def clear(self) -> None:
        self._pending = []
        for part in self.parts:
            part.clear()

    def apply(self, scale: float = 1.0) -> None:
        """One optimizer step of every member, as ``TablePart.apply`` of each (module docstring)."""
        for m, part in enumerate(self.parts):  # a caller's pushes to a part itself (TablePart.add_grad)
            if part._pending:
                self._pending += [(local + self.starts[m], g) for local, g in part._pending]
                part.clear()
        counts = {part.optimizer.step_count for part in self.parts}
        if not self._pending:
            for part in self.parts:
                part.optimizer.step_count += 1
            return
        rows, summed = sum_rows(self._pending, self.dim, scale)
        self._pending = []
        self._ensure(rows)
        w = self.weight.index_select(0, rows).to(torch.float32)
        # Each member's rows are one run of the sorted unique rows: [cuts[m], cuts[m + 1]).
        cuts: list[int] | None = None
        if len(counts) == 1:
            self.optimizer.step_count = counts.pop()
            self.optimizer.step(w, rows, summed)
            for part in self.parts:
                part.optimizer.step_count = self.optimizer.step_count
        else:  # (restored parts at different steps: each part's optimizer on its run of rows)
            cuts = self._cuts(rows)
            for m, part in enumerate(self.parts):
                a, b = cuts[m], cuts[m + 1]
                part.optimizer.step(w[a:b], rows[a:b] - self.starts[m], summed[a:b])
        if self.weight.dtype != torch.float32:
            cuts = cuts or self._cuts(rows)
            out = torch.empty(w.shape, dtype=self.weight.dtype)
            for m, part in enumerate(self.parts):
                a, b = cuts[m], cuts[m + 1]
                if b > a:  # (the part's own stream, seeded as its apply seeds it)
                    part._generator.manual_seed(_stream_seed(part.seed, part.name, part.part, part.optimizer.step_count))
                    out[a:b] = round_stochastic(w[a:b], self.weight.dtype, part._generator)
            w = out
        self.weight.index_copy_(0, rows, w)
        if self.marks is not None:
            self.marks.current[rows] = True

    def _cuts(self, rows: torch.Tensor) -> list[int]:
        return torch.searchsorted(rows, torch.tensor(self.starts, dtype=rows.dtype)).tolist()

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def table_parts(configs: Any, run_optimizer: dict[str, Any], track: bool = False
                ) -> tuple[dict[str, Any], list[TableGroup]]:
    """A ps task's parts of its tables by name (plan configs, ``dtrain.plan.tables.table_config``)
    and the groups that hold those that batch (module docstring); the others are built alone
    (:func:`table_part`). A table with its own optimizer config uses it, the others
    ``run_optimizer``. ``track``: every part marks the rows that change (incremental checkpoints)."""
    configs = list(configs)
    by_key: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in configs:
        if c.get("dynamic") is None:
            by_key.setdefault(_key(c, c.get("optimizer") or run_optimizer), []).append(c)
    groups: list[TableGroup] = []
    built: dict[str, Any] = {}
    for members in by_key.values():
        if len(members) > 1:
            groups.append(TableGroup(members, members[0].get("optimizer") or run_optimizer, track))
            built.update(zip(groups[-1].names, groups[-1].parts, strict=True))
    tables = {c["name"]: built[c["name"]] if c["name"] in built else table_part(c, run_optimizer, track)
              for c in configs}
    return tables, groups


def table_part(config: dict[str, Any], run_optimizer: dict[str, Any], track: bool = False) -> Any:
    """A ps task's part of one table, from its plan config (``dtrain.plan.tables.table_config``): a
    :class:`TablePart`, or a ``DynamicTablePart`` for a table without a vocabulary. A table with its
    own optimizer config uses it, the others ``run_optimizer``; ``track``: the part marks the rows
    that change, for incremental checkpoints."""
    settings = {k: v for k, v in config.items() if k not in ("optimizer", "dynamic")}
    optimizer = config.get("optimizer") or run_optimizer
    if config.get("dynamic") is not None:
        return DynamicTablePart(**settings, **config["dynamic"], optimizer_config=optimizer, track=track)
    return TablePart(**settings, optimizer_config=optimizer, track=track)
