"""The optimizers a ps task applies to the rows of a sparse table part (``dtrain.ps.rows``).

An optimizer step sees only the rows a step touched: a float32 block gathered from the part
(whatever the part's storage dtype), updated here in place and written back by the part. Optimizer
state is float32 and indexed by the part's local rows.

- ``sgd``: ``w[rows] -= lr * g`` (torch.optim.SGD on a sparse gradient);
- ``adagrad``: one accumulator per element (torch.optim.Adagrad on a sparse gradient: ``lr_decay``,
  ``initial_accumulator_value``, ``eps``);
- ``rowwise_adagrad``: one accumulator per row, FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (the default
  optimizer of its embedding tables) — see :class:`RowwiseAdagrad`;
- ``adam``: lazy Adam, torch.optim.SparseAdam: only the touched rows' moments change; the step
  counter (bias correction) advances every step, as the whole table's does in torch.

``weight_decay`` (sgd, adagrad, rowwise_adagrad) is L2 on touched rows, FBGEMM's
``weight_decay_mode`` L2: ``g += weight_decay * w`` for the rows a step touches, before the update.
It is not torch's dense weight decay, which would shrink every row every step; a row no batch
touches keeps its value. ``adam`` refuses it (torch.optim.SparseAdam has none).

Pure torch: no Dask.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROW_STATE = {"sgd": 0, "adagrad": 1, "adam": 2}
"""(rows, dim) float32 tensors of optimizer state a table part keeps besides its rows, for the
element-wise optimizers; ``rowwise_adagrad`` keeps one float32 per row (:func:`row_state_bytes`)."""


def row_state_bytes(name: str, rows: int, dim: int) -> int:
    """Bytes of optimizer state the row optimizer ``name`` keeps for ``rows`` rows of ``dim``."""
    if name == "rowwise_adagrad":
        return rows * 4
    return ROW_STATE[name] * rows * dim * 4


class RowOptimizer:
    """Plain SGD, and the base class. ``step(w, rows, grads)`` is one optimizer step, touched rows or
    not: ``w`` the touched rows (a float32 copy, updated in place), ``rows`` their unique local rows
    (the index of per-row state), ``grads`` their summed float32 gradients (may be overwritten)."""

    name = "sgd"

    def __init__(self, rows: int, dim: int, lr: float, weight_decay: float = 0.0):
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.step_count = 0

    def step(self, w: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        self.step_count += 1
        if len(rows):
            self._update(w, rows, grads)

    def _l2(self, w: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """L2 on touched rows (module docstring)."""
        return grads.add_(w, alpha=self.weight_decay) if self.weight_decay else grads

    def _update(self, w: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        w.add_(self._l2(w, grads), alpha=-self.lr)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-row state, by name (the first dimension of each is the part's row count)."""
        return {}

    def share(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the per-row state in ``tensors`` (by :meth:`tensors`' names: views into a table
        group's state, ``dtrain.ps.groups``) instead of tensors of its own; they are used as they are."""
        mine = self.tensors()
        if sorted(tensors) != sorted(mine):
            raise ValueError(f"{self.name} keeps state {sorted(mine) or 'none'}, not {sorted(tensors)}")
        for key, t in tensors.items():
            setattr(self, key, t)  # (each state tensor is the attribute of its name)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, **self.tensors()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state.get("step", 0))
        for key, mine in self.tensors().items():
            if state.get(key) is None:
                continue
            if tuple(state[key].shape) != tuple(mine.shape):
                raise ValueError(f"{self.name} state {key!r} of shape {tuple(state[key].shape)}, this part keeps "
                                 f"{tuple(mine.shape)}")
            mine.copy_(state[key])


class RowAdagrad(RowOptimizer):
    name = "adagrad"

    def __init__(self, rows: int, dim: int, lr: float, lr_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, weight_decay: float = 0.0):
        super().__init__(rows, dim, lr, weight_decay)
        self.lr_decay, self.eps = lr_decay, eps
        self.sum = torch.full((rows, dim), float(initial_accumulator_value), dtype=torch.float32)

    def _update(self, w: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        clr = self.lr / (1 + (self.step_count - 1) * self.lr_decay)
        grads = self._l2(w, grads)
        acc = self.sum.index_select(0, rows).add_(grads.pow(2))
        self.sum.index_copy_(0, rows, acc)
        w.add_(grads / acc.sqrt_().add_(self.eps), alpha=-clr)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"sum": self.sum}


class RowwiseAdagrad(RowOptimizer):
    """FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (``split_embedding_codegen`` ``rowwise_adagrad``, with
    ``WeightDecayMode.L2`` when ``weight_decay`` is set): one float32 accumulator ``acc`` per row.
    For a touched row ``w`` with summed gradient ``g`` (D values)::

        g_l2       = g + weight_decay * w                   (weight_decay 0: g)
        acc       += sum(g_l2 ** 2) / D
        multiplier = lr / (sqrt(acc) + eps)
        w          = (1 - multiplier * weight_decay) * w - multiplier * g

    which is ``w -= lr * g_l2 / (sqrt(acc) + eps)``, written in FBGEMM's order. Defaults: ``lr``
    required, ``eps`` 1e-8, ``weight_decay`` 0."""

    name = "rowwise_adagrad"

    def __init__(self, rows: int, dim: int, lr: float, eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(rows, dim, lr, weight_decay)
        self.eps, self.dim = float(eps), int(dim)
        self.row_sum = torch.zeros(rows, dtype=torch.float32)

    def _update(self, w: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        decayed = grads.add(w, alpha=self.weight_decay) if self.weight_decay else grads
        acc = self.row_sum.index_select(0, rows).add_(decayed.pow(2).sum(1).div_(self.dim))
        self.row_sum.index_copy_(0, rows, acc)
        multiplier = (self.lr / acc.sqrt_().add_(self.eps)).unsqueeze(1)
        if self.weight_decay:
            w.mul_(1.0 - multiplier * self.weight_decay)
        w.sub_(grads.mul_(multiplier))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"row_sum": self.row_sum}


class RowLazyAdam(RowOptimizer):
    name = "adam"

    def __init__(self, rows: int, dim: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(rows, dim, lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = eps
        self.exp_avg = torch.zeros((rows, dim), dtype=torch.float32)
        self.exp_avg_sq = torch.zeros((rows, dim), dtype=torch.float32)

    def _update(self, w: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
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
        w.add_(-step_size * numer.div_(denom))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


ROW_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def make_row_optimizer(rows: int, dim: int, config: dict[str, Any]) -> RowOptimizer:
    """The row optimizer for an optimizer config (a plain dict: the run's ``optimizer:`` section or a
    table's own); see the module docstring. Keys a row optimizer does not use are ignored (the
    run's section carries every key of its kind; a table's own config is checked by the plan)."""
    c = dict(config)
    name = c.get("name")
    if name not in ROW_OPTIMIZERS:
        raise ValueError(f"optimizer.name {name!r} does not apply to sparse tables; use "
                         f"{', '.join(ROW_OPTIMIZERS[:-1])} or {ROW_OPTIMIZERS[-1]}")
    if c.get("lr") is None:
        raise ValueError(f"optimizer {name} for a sparse table needs lr")
    if name == "adam" and c.get("weight_decay"):
        raise ValueError("optimizer.weight_decay does not apply to adam on sparse tables (torch.optim.SparseAdam has "
                         "none); sgd, adagrad and rowwise_adagrad take it as L2 on touched rows")
    if c.get("amsgrad"):
        raise ValueError("optimizer.amsgrad does not apply to sparse gradients (torch.optim.SparseAdam)")
    wd = float(c.get("weight_decay") or 0.0)
    if name == "sgd":
        return RowOptimizer(rows, dim, c["lr"], weight_decay=wd)
    if name == "adagrad":
        return RowAdagrad(rows, dim, c["lr"], lr_decay=c.get("lr_decay", 0.0),
                          initial_accumulator_value=c.get("initial_accumulator_value", 0.0), eps=c.get("eps", 1e-10),
                          weight_decay=wd)
    if name == "rowwise_adagrad":
        return RowwiseAdagrad(rows, dim, c["lr"], eps=c.get("eps", 1e-8), weight_decay=wd)
    return RowLazyAdam(rows, dim, c["lr"], betas=tuple(c.get("betas", (0.9, 0.999))), eps=c.get("eps", 1e-8))
