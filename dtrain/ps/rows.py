"""One ps task's rows of a sparse embedding table, and the optimizers that update rows.

``TablePart`` holds this task's rows of one table (TensorFlow's ``mod`` or ``div``
partition_strategy) as a (rows, dim) tensor, initialised here from the run's seed with the
table's chunked initialisation (``dtrain.model.tables.init_rows``: the same values whatever the
number of ps tasks). Replicas push (global ids, summed row gradients) and gather rows by global
id; ids are checked, so a bad id is refused before anything is read or written.

The row optimizers follow torch's sparse semantics step for step (tests/ps/test_rows.py checks
them against torch.optim on ``nn.Embedding(sparse=True)`` gradients):

- ``sgd``: ``w[rows] -= lr * g`` (torch.optim.SGD on a sparse gradient);
- ``adagrad``: per-row accumulators (torch.optim.Adagrad on a sparse gradient: ``lr_decay``,
  ``initial_accumulator_value``, ``eps``);
- ``adam``: lazy Adam, torch.optim.SparseAdam: only the touched rows' moments change; the step
  counter (bias correction) advances every step, as the whole table's does in torch.

Pure torch: no Dask.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dtrain.model.tables import global_rows, init_rows


class RowOptimizer:
    """``step(weight, rows, grads)`` updates ``weight[rows]`` (unique local rows) in place; every
    call is one optimizer step, touched rows or not."""

    def __init__(self, rows: int, dim: int, lr: float):
        self.lr = lr
        self.step_count = 0

    def step(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        self.step_count += 1
        if len(rows):
            self._update(weight, rows, grads)

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        weight.index_add_(0, rows, grads, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state.get("step", 0))


class RowAdagrad(RowOptimizer):
    def __init__(self, rows: int, dim: int, lr: float, lr_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10):
        super().__init__(rows, dim, lr)
        self.lr_decay, self.eps = lr_decay, eps
        self.sum = torch.full((rows, dim), float(initial_accumulator_value), dtype=torch.float32)

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        clr = self.lr / (1 + (self.step_count - 1) * self.lr_decay)
        acc = self.sum.index_select(0, rows).add_(grads.pow(2))
        self.sum.index_copy_(0, rows, acc)
        weight.index_add_(0, rows, grads / acc.sqrt_().add_(self.eps), alpha=-clr)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "sum": self.sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("sum") is not None:
            self.sum.copy_(state["sum"])


class RowLazyAdam(RowOptimizer):
    def __init__(self, rows: int, dim: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(rows, dim, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = eps
        self.exp_avg = torch.zeros((rows, dim), dtype=torch.float32)
        self.exp_avg_sq = torch.zeros((rows, dim), dtype=torch.float32)

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        # torch.optim.SparseAdam's arithmetic, in its order (so the results agree to the last bits).
        old_avg = self.exp_avg.index_select(0, rows)
        avg_update = grads.sub(old_avg).mul_(1 - self.beta1)
        self.exp_avg.index_add_(0, rows, avg_update)
        old_sq = self.exp_avg_sq.index_select(0, rows)
        sq_update = grads.pow(2).sub_(old_sq).mul_(1 - self.beta2)
        self.exp_avg_sq.index_add_(0, rows, sq_update)
        numer = avg_update.add_(old_avg)
        sq_update.add_(old_sq)
        denom = sq_update.sqrt_().add_(self.eps)
        step = self.step_count
        step_size = self.lr * math.sqrt(1 - self.beta2 ** step) / (1 - self.beta1 ** step)
        weight.index_add_(0, rows, -step_size * numer.div_(denom))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key in ("exp_avg", "exp_avg_sq"):
            if state.get(key) is not None:
                getattr(self, key).copy_(state[key])


ROW_STATE = {"sgd": 0, "adagrad": 1, "adam": 2}
"""(rows, dim) tensors of optimizer state a table part keeps per optimizer, besides its rows."""


def make_row_optimizer(rows: int, dim: int, config: dict[str, Any]) -> RowOptimizer:
    """The row optimizer for an ``optimizer:`` section (a plain dict); see the module docstring."""
    c = dict(config)
    name = c.get("name")
    for key in ("weight_decay",):
        if c.get(key):
            raise ValueError(f"optimizer.{key} does not apply to sparse gradients; sparse tables take sgd, adagrad "
                             "or adam without it")
    if c.get("amsgrad"):
        raise ValueError("optimizer.amsgrad does not apply to sparse gradients (torch.optim.SparseAdam)")
    if name == "sgd":
        return RowOptimizer(rows, dim, c["lr"])
    if name == "adagrad":
        return RowAdagrad(rows, dim, c["lr"], lr_decay=c.get("lr_decay", 0.0),
                          initial_accumulator_value=c.get("initial_accumulator_value", 0.0), eps=c.get("eps", 1e-10))
    if name == "adam":
        return RowLazyAdam(rows, dim, c["lr"], betas=tuple(c.get("betas", (0.9, 0.999))), eps=c.get("eps", 1e-8))
    raise ValueError(f"optimizer.name {name!r} does not apply to sparse tables; use sgd, adagrad or adam")


class TablePart:
    """This ps task's rows of one table, their optimizer and the step's gradient accumulator."""

    def __init__(self, name: str, num_embeddings: int, dim: int, num_parts: int, part: int, strategy: str,
                 init_std: float, seed: int, optimizer_config: dict[str, Any]):
        self.name, self.num_embeddings, self.dim = name, int(num_embeddings), int(dim)
        self.num_parts, self.part, self.strategy = int(num_parts), int(part), strategy
        self.rows = global_rows(self.num_embeddings, self.num_parts, self.part, strategy)
        self.weight = torch.empty((len(self.rows), self.dim), dtype=torch.float32)
        init_rows(seed, name, self.num_embeddings, self.dim, init_std, self.rows, out=self.weight)
        self.optimizer = make_row_optimizer(len(self.rows), self.dim, optimizer_config)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def check_ids(self, ids: torch.Tensor | None) -> str | None:
        """Why ``ids`` cannot be served here (an id outside the table or on another task), or None."""
        if ids is None or not len(ids):
            return None
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if self.strategy == "mod":
            bad |= ids % self.num_parts != self.part
        else:
            bad |= (ids < self.rows.start) | (ids >= self.rows.stop)
        if bool(bad.any()):
            first = int(ids[torch.nonzero(bad)[0, 0]])
            where = "outside" if not 0 <= first < self.num_embeddings else f"not on ps part {self.part} of"
            return (f"id {first} is {where} table {self.name} (num_embeddings {self.num_embeddings}, ids 0.."
                    f"{self.num_embeddings - 1})")
        return None

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64)
        return ids // self.num_parts if self.strategy == "mod" else ids - self.rows.start

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of global ``ids`` (checked by the caller with :meth:`check_ids`), a copy."""
        return self.weight.index_select(0, self._local(ids))

    def add_grad(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One replica's sparse gradient for this step (applied, summed per id, by :meth:`apply`)."""
        self._pending.append((self._local(ids), grads.to(torch.float32)))

    def clear(self) -> None:
        self._pending = []

    def apply(self, scale: float = 1.0) -> None:
        """One optimizer step with the step's gradients summed per id and multiplied by ``scale``."""
        if self._pending:
            local = torch.cat([i for i, _ in self._pending])
            grads = torch.cat([g for _, g in self._pending])
            rows, inverse = torch.unique(local, return_inverse=True)
            summed = torch.zeros((len(rows), self.dim), dtype=torch.float32).index_add_(0, inverse, grads)
            if scale != 1.0:
                summed.mul_(scale)
        else:
            rows, summed = torch.empty(0, dtype=torch.int64), torch.empty((0, self.dim))
        self._pending = []
        self.optimizer.step(self.weight, rows, summed)

    def state(self, copy: bool = False) -> dict[str, Any]:
        """Rows and optimizer state (``copy``: cloned, else the live tensors)."""
        if copy:
            return self.chunk(0, len(self.rows))
        return {"weight": self.weight, "optimizer": self.optimizer.state_dict()}

    def chunk(self, start: int, stop: int) -> dict[str, Any]:
        """Rows ``[start, stop)`` (local) and their optimizer state, copied; the step count whole."""
        state = self.optimizer.state_dict()
        return {"weight": self.weight[start:stop].clone(),
                "optimizer": {k: v[start:stop].clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        if tuple(state["weight"].shape) != tuple(self.weight.shape):
            raise ValueError(f"table {self.name} part {self.part}: a state of shape {tuple(state['weight'].shape)}, "
                             f"this part holds {tuple(self.weight.shape)} (another ps count or partition?)")
        self.weight.copy_(state["weight"])
        self.optimizer.load_state_dict(dict(state.get("optimizer") or {}))
        self._pending = []

    @property
    def nbytes(self) -> int:
        state = self.optimizer.state_dict()
        return self.weight.numel() * 4 + sum(v.numel() * 4 for v in state.values() if isinstance(v, torch.Tensor))
