"""Optimizers over one flat parameter buffer, with torch.optim's semantics.

The ps applies updates to a shard's flat buffer. torch.optim's SGD, SGD with momentum, Adam and
Adagrad are elementwise, so applying them to a flat buffer is exactly their per-tensor behaviour;
these classes reproduce torch's single-tensor (``foreach=False``) code paths step for step
(tests/test_optim.py checks them against torch.optim). Two reasons not to call torch.optim in
the ps: constructing a torch optimizer imports torch._dynamo and friends (about 75 MB more
resident memory in every ps process, for a few KB of state), and torch.optim allocates
temporaries every step (Adam's denominator), where these keep persistent buffers.

State (for checkpoints) is a plain ``dict`` of tensors and numbers: no OrderedDict on the wire.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class FlatOptimizer:
    """Base class: ``step(param, grad, scale)`` updates ``param`` in place with the gradient
    ``scale * grad`` (a sync step's mean: the sum times 1/count). ``grad`` is never kept; it is
    never written either when ``scale`` is 1, and may be scaled in place otherwise (where the scale
    cannot be folded into the update's own multiplier, as plain SGD's and momentum's is).
    ``param`` and ``grad`` never require grad (the shard detaches its buffer; gradients come off
    the wire), so ``step`` runs without ``torch.no_grad()``, whose context costs more than the
    update itself on a small shard (2 µs against 1.3 µs for SGD on 1,000 values)."""

    def __init__(self, numel: int, lr: float, weight_decay: float = 0.0):
        self.lr = lr
        self.weight_decay = weight_decay
        self.numel = numel
        self._tmp = torch.empty(numel, dtype=torch.float32)

    @staticmethod
    def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
        return grad if scale == 1.0 else grad.mul_(scale)

    def _decayed(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if self.weight_decay == 0:
            return grad
        return torch.add(grad, param, alpha=self.weight_decay, out=self._tmp)

    def step(self, param: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:  # pragma: no cover
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SGD(FlatOptimizer):
    """torch.optim.SGD (plain, momentum, dampening, nesterov, weight decay)."""

    def __init__(self, numel: int, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(numel, lr, weight_decay)
        self.momentum, self.dampening, self.nesterov = momentum, dampening, nesterov
        self.buf: torch.Tensor | None = None

    def step(self, param: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        if self.weight_decay or self.nesterov:  # (the scale is folded into the multipliers below otherwise)
            grad, scale = self._scaled(grad, scale), 1.0
        grad = self._decayed(param, grad)
        if self.momentum != 0:
            if self.buf is None:
                self.buf = torch.mul(grad, scale) if scale != 1.0 else grad.detach().clone()
            else:
                self.buf.mul_(self.momentum).add_(grad, alpha=(1 - self.dampening) * scale)
            scale = 1.0
            if self.nesterov:
                grad = torch.add(grad, self.buf, alpha=self.momentum, out=self._tmp)
            else:
                grad = self.buf
        param.add_(grad, alpha=-self.lr * scale)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.buf is None else {"momentum_buffer": self.buf.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buf = state.get("momentum_buffer")
        self.buf = None if buf is None else buf.detach().to(torch.float32).clone()


class Adam(FlatOptimizer):
    """torch.optim.Adam (with amsgrad and L2 weight decay)."""

    def __init__(self, numel: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 amsgrad: bool = False, weight_decay: float = 0.0):
        super().__init__(numel, lr, weight_decay)
        self.beta1, self.beta2 = betas
        self.eps, self.amsgrad = eps, amsgrad
        self.t = 0
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.max_exp_avg_sq = torch.zeros(numel) if amsgrad else None
        self._denom = torch.empty(numel)

    def step(self, param: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        self.t += 1
        grad = self._decayed(param, self._scaled(grad, scale))
        self.exp_avg.lerp_(grad, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1 ** self.t
        bias_correction2 = 1 - self.beta2 ** self.t
        step_size = self.lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        second = self.exp_avg_sq
        if self.max_exp_avg_sq is not None:
            torch.maximum(self.max_exp_avg_sq, self.exp_avg_sq, out=self.max_exp_avg_sq)
            second = self.max_exp_avg_sq
        torch.sqrt(second, out=self._denom)
        self._denom.div_(bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(self.exp_avg, self._denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.t, "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()}
        if self.max_exp_avg_sq is not None:
            state["max_exp_avg_sq"] = self.max_exp_avg_sq.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.t = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if self.max_exp_avg_sq is not None and "max_exp_avg_sq" in state:
            self.max_exp_avg_sq.copy_(state["max_exp_avg_sq"])


class Adagrad(FlatOptimizer):
    """torch.optim.Adagrad (lr decay, initial accumulator, weight decay)."""

    def __init__(self, numel: int, lr: float, lr_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, weight_decay: float = 0.0):
        super().__init__(numel, lr, weight_decay)
        self.lr_decay, self.eps = lr_decay, eps
        self.t = 0
        self.sum = torch.full((numel,), float(initial_accumulator_value))
        self._std = torch.empty(numel)

    def step(self, param: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        self.t += 1
        grad = self._decayed(param, self._scaled(grad, scale))
        clr = self.lr / (1 + (self.t - 1) * self.lr_decay)
        self.sum.addcmul_(grad, grad, value=1)
        torch.sqrt(self.sum, out=self._std)
        self._std.add_(self.eps)
        param.addcdiv_(grad, self._std, value=-clr)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.t, "sum": self.sum.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.t = int(state["step"])
        self.sum.copy_(state["sum"])


def make_optimizer(numel: int, config: dict[str, Any]) -> FlatOptimizer:
    """The flat optimizer for an ``optimizer:`` section (as a plain dict)."""
    c = dict(config)
    name = c.pop("name")
    wd = c.get("weight_decay", 0.0)
    if name == "sgd":
        return SGD(numel, c["lr"], weight_decay=wd)
    if name == "momentum":
        return SGD(numel, c["lr"], momentum=c.get("momentum", 0.9), dampening=c.get("dampening", 0.0),
                   nesterov=c.get("nesterov", False), weight_decay=wd)
    if name == "adam":
        return Adam(numel, c["lr"], betas=tuple(c.get("betas", (0.9, 0.999))), eps=c.get("eps", 1e-8),
                    amsgrad=c.get("amsgrad", False), weight_decay=wd)
    if name == "adagrad":
        return Adagrad(numel, c["lr"], lr_decay=c.get("lr_decay", 0.0),
                       initial_accumulator_value=c.get("initial_accumulator_value", 0.0), eps=c.get("eps", 1e-10),
                       weight_decay=wd)
    raise ValueError(f"unknown optimizer {name!r}; use sgd, momentum, adam or adagrad")
