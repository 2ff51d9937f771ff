"""The ps's side of sparse tables, mixed into ``ParameterShard``: checking a request's ids,
adding row gradients to this task's table parts, and gathering the rows a replica asks for.

A request's ``sparse`` argument maps a table's name to (the ids whose row gradients it pushes,
those gradients, the ids of the replica's next batch whose rows it wants back); ids are global
and already on this task (the replica routes them: ``dtrain.worker.tables.SparseRouter``).
"""

from __future__ import annotations

from typing import Any

import torch

from .rows import TablePart, pack_state

Sparse = dict[str, tuple[Any, Any, Any]]  # table name -> (ids, row gradients, next ids); any may be None
Reply = tuple[Any, ...]  # (params, step, stop, generation[, rows])


def rows_bytes(sparse: Sparse) -> int:
    """A push's table rows: ids, row gradients, next ids (the dense gradient is the shard's size)."""
    return sum(int(getattr(t, "nbytes", 0)) for block in sparse.values() for t in block if t is not None)


class SparseRows:
    """Mixin: ``self.tables`` (name -> TablePart), ``self.index`` and ``self.error`` come from the shard."""

    tables: dict[str, TablePart]
    index: int
    error: str | None

    def _bad_ids(self, sparse: Sparse | None, replica: int) -> bool:
        """An id outside its table (or not on this task) fails the run, naming the table and the id;
        nothing is read or written (a custom module may compute ids the data checks never saw)."""
        if not sparse:
            return False
        for name, (push_ids, _grads, pull_ids) in sparse.items():
            part = self.tables.get(name)
            why = f"no table {name!r} on ps shard {self.index}" if part is None else \
                part.check_ids(push_ids) or part.check_ids(pull_ids)
            if why:
                self.error = self.error or f"replica {replica}: {why}"
                return True
        return False

    def _add_rows(self, sparse: Sparse | None) -> None:
        for name, (ids, grads, _pull) in (sparse or {}).items():
            if ids is not None and len(ids):
                self.tables[name].add_grad(ids, grads)

    def _rows(self, sparse: Sparse | None) -> dict[str, torch.Tensor]:
        """The rows a replica asked for (its next batch's ids on this task), after the update."""
        return {name: self.tables[name].gather(pull) for name, (_i, _g, pull) in (sparse or {}).items()
                if pull is not None and name in self.tables}

    def _clear_rows(self) -> None:
        for part in self.tables.values():
            part.clear()

    async def gather_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of table ``name`` (global ``ids`` held by this task): evaluation and ``model.pt``."""
        part = self.tables[name]
        if why := part.check_ids(ids):
            raise IndexError(why)
        return part.lookup(ids)  # (a table without a vocabulary admits no id for an evaluation)

    async def read_part(self, name: str, start: int, stop: int) -> dict[str, Any]:
        """Local rows ``[start, stop)`` of this task's part of table ``name`` and their optimizer
        state (copies of that chunk only): a checkpoint reads a part in chunks, so the ps never
        holds a second copy of its table (the chief holds applies while it reads). Packed for Dask
        (bfloat16 rows as int16 bits: :func:`dtrain.ps.rows.unpack_state`)."""
        return pack_state(self.tables[name].chunk(start, stop))
