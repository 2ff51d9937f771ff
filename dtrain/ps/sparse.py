"""The ps's side of sparse tables, a part of ``ParameterShard`` (:class:`ShardTables`): this
task's table parts, checking a request's ids, adding row gradients to the parts, applying them,
and gathering the rows a replica asks for. The shard calls every method under its ``lock``
(pushes on the data plane's connection threads and the event loop's methods alike).

A request's ``sparse`` argument maps a table's name to (the ids whose row gradients it pushes,
those gradients, the ids of the replica's next batch whose rows it wants back); ids are global
and already on this task (the replica routes them: ``dtrain.worker.tables.SparseRouter``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dtrain.dataplane.rows import SparseBlock

from .dynamic import DynamicTablePart
from .groups import TableGroup, table_parts
from .rows import TablePart

DRAW_AT_START = 1 << 25
"""Values (rows x dim) of the parts initialised per id that a ps task draws when it starts (about
0.2 s; their memory is the table's own, allocated anyway): every part of a model whose tables are
a few million rows (a DLRM at Criteo's 1% scale), a large model's smaller tables. A row not
drawn then is drawn the first time a step touches it, at several times the cost per row (a small
call per table and step while most of a large table's rows are new)."""

Part = TablePart | DynamicTablePart
# table name -> (ids, row gradients, next ids), any may be None; or a SparseBlock (the same, side by side)
Sparse = Mapping[str, tuple[Any, Any, Any]]
Reply = tuple[Any, ...]  # (params, step, stop, generation[, rows])
_Batch = tuple[list[int], list[Any], list[Any], list[str]]  # (members, tensors, gradients, names), one entry each


def rows_bytes(sparse: Sparse) -> int:
    """A push's table rows: ids, row gradients, next ids (the dense gradient is the shard's size)."""
    if isinstance(sparse, SparseBlock):
        return sparse.nbytes
    return sum(int(getattr(t, "nbytes", 0)) for block in sparse.values() for t in block if t is not None)


class ShardTables(Mapping[str, Part]):
    """This ps task's table parts (table name -> part, read-only mapping) and the work a request
    does on them. The parts of a :class:`~dtrain.ps.groups.TableGroup` are served through their
    group, a request's tables in one batch per group; the others part by part. The shard calls
    every method under its ``lock``."""

    def __init__(self, configs: Any, run_optimizer: dict[str, Any], track: bool = False, shard: int = 0,
                 draw: int = DRAW_AT_START):
        """``configs``: the plan's table configs of this task; ``track``: mark changed rows (incremental
        checkpoints); ``shard``: this task's shard index (for messages); ``draw``: values of the
        smallest per-id parts drawn now (:meth:`draw_small_parts`)."""
        self.parts, self.groups = table_parts(configs, run_optimizer, track)
        self.shard = shard
        self._grouped = {name: (group, m) for group in self.groups for m, name in enumerate(group.names)}
        self._alone = [part for name, part in self.parts.items() if name not in self._grouped]
        self._members: dict[tuple[str, ...], tuple[TableGroup, torch.Tensor] | None] = {}
        self.draw_small_parts(draw)

    def _one_group(self, block: SparseBlock) -> tuple[TableGroup, torch.Tensor] | None:
        """(the group, each table's member index) when every table of ``block`` is one group's
        member and pushes rows of its width (the batched path: the block's flat tensors, no
        tensor per table), else None. Remembered per list of names (a replica sends the same list
        every step)."""
        key = tuple(block.names)
        if key not in self._members:
            where = [self._grouped.get(name) for name in key]
            one = None
            if where and all(w is not None for w in where) and len({id(w[0]) for w in where if w}) == 1:
                group = where[0][0]  # type: ignore[index]
                one = (group, torch.tensor([w[1] for w in where if w is not None]))
            self._members[key] = one
        one = self._members[key]
        return one if one is not None and block.width in (None, one[0].dim) else None

    @staticmethod
    def _which(block: SparseBlock, members: torch.Tensor, kind: str) -> torch.Tensor:
        """Each pushed (``kind`` "push") or wanted ("want") id's member of the group, made once
        per block (the check, the add and the gather each read it)."""
        key = (kind, id(members))  # (a block one process's two tasks both read: each its own)
        which = block.memo.get(key)
        if which is None:
            counts, ids = (block.push, block.ids) if kind == "push" else (block.want, block.wanted)
            which = block.memo[key] = members.repeat_interleave(torch.tensor(counts), output_size=len(ids))
        return which

    def _rows(self, block: SparseBlock, group: TableGroup, members: torch.Tensor, kind: str) -> torch.Tensor | None:
        """The group rows of the block's pushed (``kind`` "push") or wanted ("want") ids, checked
        (None: an id outside its table or not on this task), made once per block: the check, the
        add and the gather each read them."""
        key = ("rows", kind, id(members))
        if key not in block.memo:
            flat = block.ids if kind == "push" else block.wanted
            block.memo[key] = group.checked_rows(flat, self._which(block, members, kind))
        return block.memo[key]

    def _checked_rows(self, block: SparseBlock, group: TableGroup, members: torch.Tensor, kind: str) -> torch.Tensor:
        """:meth:`_rows` of a block that passed :meth:`why_bad` (a bad id never gets this far)."""
        rows = self._rows(block, group, members, kind)
        if rows is None:
            raise ValueError(self.why_bad(block) or "ids outside their tables")
        return rows

    def __getitem__(self, name: str) -> Part:
        return self.parts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def draw_small_parts(self, budget: int) -> None:
        """Draw the rows of this task's smallest parts initialised per id (``TablePart.ensure``),
        ``budget`` values in all, now: the same values as on first use (a function of the id),
        without a dozen small calls per table in every step while most of their rows are new.
        Larger parts start undrawn (their untouched rows take no memory)."""
        lazy = sorted(((len(part.rows) * part.dim, name, part) for name, part in self.parts.items()
                       if isinstance(part, TablePart) and part._fresh is not None), key=lambda e: e[:2])
        for size, _name, part in lazy:
            if size > budget:
                break
            budget -= size
            part.draw_all()

    def _batches(self, sparse: Sparse, slots: tuple[int, ...]) -> tuple[dict[TableGroup, _Batch], list[str]]:
        """The request's entries ``slots`` (0 ids, 1 gradients, 2 next ids) per group (members, the
        non-empty tensors of each slot, the members' names), and the names of the other tables."""
        batches: dict[TableGroup, _Batch] = {}
        alone = []
        for name, entry in sparse.items():
            where = self._grouped.get(name)
            if where is None:
                alone.append(name)
                continue
            group, m = where
            for slot in slots:
                ids = entry[slot]
                if ids is not None and ids.numel():  # (numel: len() on a tensor is a Python call)
                    batch = batches.setdefault(group, ([], [], [], []))
                    batch[0].append(m)
                    batch[1].append(ids)
                    batch[2].append(entry[slot + 1] if slot == 0 else None)
                    batch[3].append(name)
        return batches, alone

    def why_bad(self, sparse: Sparse | None) -> str | None:
        """Why a request cannot be served (the first id outside its table or not on this task, in
        the request's order, naming the table and the id), or None."""
        if not sparse:
            return None
        if isinstance(sparse, SparseBlock) and (one := self._one_group(sparse)) is not None:
            g, which = one
            if self._rows(sparse, g, which, "push") is not None and self._rows(sparse, g, which, "want") is not None:
                return None
        batches, alone = self._batches(sparse, (0, 2))
        if all(group.valid(b[0], b[1]) for group, b in batches.items()) and all(
                name in self.parts and not self.parts[name].check_ids(sparse[name][0])
                and not self.parts[name].check_ids(sparse[name][2]) for name in alone):
            return None
        for name, (push_ids, _grads, pull_ids) in sparse.items():
            part = self.parts.get(name)
            why = f"no table {name!r} on ps shard {self.shard}" if part is None else \
                part.check_ids(push_ids) or part.check_ids(pull_ids)
            if why:
                return why
        return None

    def add(self, sparse: Sparse | None) -> None:
        """One replica's row gradients of this step (applied, summed per id, by :meth:`apply`)."""
        if not sparse:
            return
        if isinstance(sparse, SparseBlock) and (one := self._one_group(sparse)) is not None:
            g, which = one
            if sparse.grads is not None and len(sparse.ids):
                g.add_rows(self._checked_rows(sparse, g, which, "push"), sparse.grads.view(len(sparse.ids), g.dim))
            return
        batches, alone = self._batches(sparse, (0,))
        for group, (members, ids, grads, _names) in batches.items():
            group.add_grad(members, ids, grads)
        for name in alone:
            ids, grads, _pull = sparse[name]
            if ids is not None and len(ids):
                self.parts[name].add_grad(ids, grads)

    def gather(self, sparse: Sparse | None) -> dict[str, torch.Tensor] | torch.Tensor:
        """The rows a replica asked for (its next batch's ids on this task), after the update: per
        table, or, for a :class:`SparseBlock` of one group's tables, side by side in its order."""
        if not sparse:
            return {}
        if isinstance(sparse, SparseBlock) and (one := self._one_group(sparse)) is not None:
            g, which = one
            return g.gather_rows(self._checked_rows(sparse, g, which, "want"))
        batches, alone = self._batches(sparse, (2,))
        out = {}
        for name, (_ids, _grads, pull) in sparse.items():  # (a grouped table's empty ids: not in its batch)
            if pull is not None and name in self.parts and (name in alone or not pull.numel()):
                out[name] = self.parts[name].gather(pull)
        for group, (members, ids, _grads, names) in batches.items():
            out.update(zip(names, group.gather(members, ids), strict=True))
        return out

    def snapshot_taken(self) -> None:
        """A checkpoint's writer holds the tables as they are: their changes count afresh from
        here (at no cost under the hold: :class:`~dtrain.ps.rows.ChangeMarks`)."""
        for group in self.groups:
            if group.marks is not None:
                group.marks.flip()
        for part in self._alone:
            part.snapshot_taken()

    def clear_spare_marks(self) -> None:
        """Clear the change marks the last snapshot left (off the hold, without the shard's lock:
        no push writes the spare marks; before the next flip)."""
        for marks in [g.marks for g in self.groups] + [getattr(p, "marks", None) for p in self._alone]:
            if marks is not None:
                marks.clear_spare()

    def clear(self) -> None:
        """Drop the row gradients added since the last apply."""
        for group in self.groups:
            group.clear()
        for part in self._alone:
            part.clear()

    def apply(self, scale: float) -> None:
        """Every part's optimizer step (every part counts the step, touched or not, as torch's table)."""
        for group in self.groups:
            group.apply(scale)
        for part in self._alone:
            part.apply(scale)

    def lookup(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of table ``name`` (global ``ids`` held by this task), without admitting an id:
        evaluation and ``model.pt``. IndexError naming the first id this task does not hold."""
        part = self.parts[name]
        if why := part.check_ids(ids):
            raise IndexError(why)
        return part.lookup(ids)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per table, this task's part: rows held, bytes, and the dynamic tables' counters."""
        return {name: part.stats() for name, part in self.parts.items()}
