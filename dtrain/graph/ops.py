"""The ops of graph pipelines: pure torch on float32 tensors (never touches Dask).

Strings are Python ``str`` values (a graph pipeline's string constants): ``identity`` passes one
on and ``add`` concatenates two, as TF's ``add`` does on ``tf.string``; the other ops take numbers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.spec.graph import GRAPH_OPS


class OpError(ValueError):
    """A graph node failed on its worker; the message names the node and its op."""


def _matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"matmul needs inputs of rank >= 1, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    inner_x, inner_y = x.shape[-1], (y.shape[0] if y.dim() == 1 else y.shape[-2])
    if inner_x != inner_y:
        raise ValueError(f"matmul: shapes {tuple(x.shape)} and {tuple(y.shape)} are not aligned "
                         f"({inner_x} != {inner_y})")
    return torch.matmul(x, y)


def _elementwise(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        try:
            torch.broadcast_shapes(x.shape, y.shape)
        except RuntimeError:
            raise ValueError(f"{name}: shapes {tuple(x.shape)} and {tuple(y.shape)} do not broadcast") from None
        return fn(x, y)

    op.__name__ = name
    return op


OPS: dict[str, Callable[..., torch.Tensor]] = {
    "add": _elementwise("add", torch.add),
    "sub": _elementwise("sub", torch.sub),
    "mul": _elementwise("mul", torch.mul),
    "div": _elementwise("div", torch.div),
    "matmul": _matmul,
    "neg": torch.neg,
    "identity": lambda x: x.clone(),
    "sum": torch.sum,
    "mean": torch.mean,
    "square": torch.square,
    "sqrt": torch.sqrt,
    "relu": torch.relu,
    "exp": torch.exp,
    "maximum": _elementwise("maximum", torch.maximum),
    "minimum": _elementwise("minimum", torch.minimum),
    "pow": _elementwise("pow", torch.pow),
}
ARITY = {name: 2 if name in ("add", "sub", "mul", "div", "matmul", "maximum", "minimum", "pow") else 1
         for name in GRAPH_OPS}
assert set(OPS) == set(GRAPH_OPS), "every GRAPH_OPS name needs a function"


def to_tensor(value: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    """A float32 tensor from a number, a nested list or a tensor (ragged lists: ValueError)."""
    try:
        return torch.as_tensor(value, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"not a number or a rectangular nested list of numbers: {exc}") from None


def apply_op(op: str, inputs: Sequence[Any], device: str | torch.device = "cpu") -> torch.Tensor | str:
    """Evaluate one op on numbers, nested lists or tensors (or strings: ``identity``, ``add``);
    ValueError naming the op otherwise."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(GRAPH_OPS)}")
    if len(inputs) != ARITY[op]:
        raise ValueError(f"{op} takes {ARITY[op]} input(s), got {len(inputs)}")
    if any(isinstance(v, str) for v in inputs):
        if op == "identity" or (op == "add" and all(isinstance(v, str) for v in inputs)):
            return "".join(inputs)
        raise ValueError(f"{op} takes numbers, got a string ({', '.join(repr(v) for v in inputs)}); strings take "
                         "identity and add (which concatenates two strings)")
    return OPS[op](*(to_tensor(v, device) for v in inputs))


def to_python(value: torch.Tensor | str) -> float | list | str:
    """A Python float (0-d), nested list of floats, or the string as it is."""
    if isinstance(value, str):
        return value
    return value.detach().cpu().tolist()
