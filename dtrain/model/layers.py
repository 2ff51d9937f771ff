"""Layer lists -> ``torch.nn.Sequential``, with every shape inferred and checked first.

Pure torch (no Dask, no spec objects): every function takes plain arguments.

A layer is a plain dict such as ``{"type": "linear", "out": 128}``.  Keys other than
``type`` and the builder's own parameters (``name``, ``device``, ...) are ignored here;
the spec validates them.  Shapes never include the batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Shape = tuple[int, ...]
Builder = Callable[[Shape, Mapping[str, Any]], nn.Module]


class LayerError(ValueError):
    """A layer that cannot be built (unknown type, bad parameter); ``.index`` is its position."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.message = message


class LayerShapeError(LayerError):
    """A layer whose input shape does not fit it, or which produces an empty shape."""


class NotAModuleError(TypeError, ValueError):
    """A custom model factory returned something that is not a ``torch.nn.Module``."""


# --------------------------------------------------------------------------- builders


def _req(params: Mapping[str, Any], key: str) -> Any:
    if key not in params or params[key] is None:
        raise ValueError(f"missing required parameter '{key}'")
    return params[key]


_REQUIRED: Any = object()


def _int(params: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
    value = _req(params, key) if default is _REQUIRED else params.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _pair_or_int(params: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> Any:
    value = _req(params, key) if default is _REQUIRED else params.get(key, default)
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) not in (1, 2) or any(
        isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in items
    ):
        raise ValueError(f"'{key}' must be an integer >= {minimum} or a pair of them, got {value!r}")
    return items[0] if len(items) == 1 else tuple(items)


class _ShapeMismatch(ValueError):
    """Internal: a builder's shape complaint, turned into ``LayerShapeError`` with context."""

    def __init__(self, expects: str, hint: str = "") -> None:
        super().__init__(expects)
        self.expects = expects
        self.hint = hint


def _expect_dims(in_shape: Shape, dims: int, layout: str, hint: str = "") -> None:
    if len(in_shape) != dims:
        raise _ShapeMismatch(f"input of shape {layout}", hint)


def _linear(in_shape: Shape, p: Mapping[str, Any]) -> nn.Module:
    out = _int(p, "out")
    expected = _int(p, "in", None)
    flatten = "add {type: flatten} before it"
    if len(in_shape) > 2:
        raise _ShapeMismatch("input of shape (features,) or (length, features)", flatten)
    if expected is not None and in_shape[-1] != expected:
        raise _ShapeMismatch(
            f"input of shape (..., {expected})", flatten if math.prod(in_shape) == expected else ""
        )
    return nn.Linear(in_shape[-1], out, bias=bool(p.get("bias", True)))


_CHW_HINT = "add {type: reshape, shape: [C, H, W]} before it"


def _conv2d(in_shape: Shape, p: Mapping[str, Any]) -> nn.Module:
    _expect_dims(in_shape, 3, "(C, H, W)", _CHW_HINT if len(in_shape) == 1 else "")
    return nn.Conv2d(
        in_shape[0],
        _int(p, "out"),
        kernel_size=_pair_or_int(p, "kernel_size"),
        stride=_pair_or_int(p, "stride", 1),
        padding=_pair_or_int(p, "padding", 0, minimum=0),
        dilation=_pair_or_int(p, "dilation", 1),
        bias=bool(p.get("bias", True)),
    )


def _pool(kind: str, cls: type[nn.Module]) -> Builder:
    def build(in_shape: Shape, p: Mapping[str, Any]) -> nn.Module:
        _expect_dims(in_shape, 3, "(C, H, W)", _CHW_HINT if len(in_shape) == 1 else "")
        return cls(
            kernel_size=_pair_or_int(p, "kernel_size"),
            stride=_pair_or_int(p, "stride", None),
            padding=_pair_or_int(p, "padding", 0, minimum=0),
        )

    return build


def _batch_norm1d(in_shape: Shape, p: Mapping[str, Any]) -> nn.Module:
    if len(in_shape) not in (1, 2):
        raise _ShapeMismatch("input of shape (C,) or (C, L)", "add {type: flatten} before it")
    return nn.BatchNorm1d(in_shape[0], eps=float(p.get("eps", 1e-5)), momentum=float(p.get("momentum", 0.1)))


def _reshape(in_shape: Shape, p: Mapping[str, Any]) -> nn.Module:
    shape = _req(p, "shape")
    if (
        not isinstance(shape, (list, tuple))
        or not shape
        or any(isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1) for s in shape)
        or list(shape).count(-1) > 1
    ):
        raise ValueError(f"'shape' must be a list of positive integers (at most one -1), got {shape!r}")
    total = math.prod(in_shape)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape and total % known:
        raise _ShapeMismatch(f"a multiple of {known} elements to reshape to {tuple(shape)}")
    if -1 not in shape and known != total:
        raise _ShapeMismatch(f"{known} elements to reshape to {tuple(shape)}")
    return _Reshape(tuple(shape))


class _Reshape(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def _no_params(factory: Callable[[Mapping[str, Any]], nn.Module]) -> Builder:
    return lambda in_shape, p: factory(p)


LAYER_TYPES: dict[str, Builder] = {
    "linear": _linear,
    "relu": _no_params(lambda p: nn.ReLU()),
    "tanh": _no_params(lambda p: nn.Tanh()),
    "gelu": _no_params(lambda p: nn.GELU()),
    "sigmoid": _no_params(lambda p: nn.Sigmoid()),
    "silu": _no_params(lambda p: nn.SiLU()),
    "leaky_relu": _no_params(lambda p: nn.LeakyReLU(float(p.get("negative_slope", 0.01)))),
    "elu": _no_params(lambda p: nn.ELU(float(p.get("alpha", 1.0)))),
    "identity": _no_params(lambda p: nn.Identity()),
    "dropout": _no_params(lambda p: nn.Dropout(float(p.get("p", 0.5)))),
    "flatten": _no_params(lambda p: nn.Flatten(start_dim=1)),
    "conv2d": _conv2d,
    "max_pool2d": _pool("max_pool2d", nn.MaxPool2d),
    "avg_pool2d": _pool("avg_pool2d", nn.AvgPool2d),
    "batch_norm1d": _batch_norm1d,
    "layer_norm": lambda s, p: nn.LayerNorm(s[-1], eps=float(p.get("eps", 1e-5))),
    "reshape": _reshape,
    # tables take integer ids and must come first (_build_one names them by their index)
    "embedding": lambda s, p: _table(0, p),
    "embedding_bag": lambda s, p: _table(0, p),
}
"""YAML layer type -> builder ``(in_shape, params) -> nn.Module``.

Parameters: ``linear`` (out, bias=True, optional ``in`` checked against the input's last
dim; input (features,) or (length, features)), ``leaky_relu`` (negative_slope=0.01), ``elu`` (alpha=1.0), ``dropout`` (p=0.5),
``conv2d`` (out, kernel_size, stride=1, padding=0, dilation=1, bias=True; input (C,H,W)),
``max_pool2d``/``avg_pool2d`` (kernel_size, stride=kernel_size, padding=0; input (C,H,W)),
``batch_norm1d`` (eps, momentum; input (C,) or (C,L)), ``layer_norm`` (eps; last dim),
``reshape`` (shape: non-batch dims, one may be -1), ``flatten`` (all non-batch dims)."""


# --------------------------------------------------------------------------- shapes


def _describe(index: int, layers: Sequence[Mapping[str, Any]]) -> str:
    if index < 0:
        return "the input"
    layer = layers[index]
    name = layer.get("name")
    return f"layer {index}" + (f" '{name}'" if name else "") + f" ({layer.get('type')})"


def _check_input_shape(input_shape: Sequence[int]) -> Shape:
    shape = tuple(input_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"input_shape must be a non-empty list of positive integers, got {list(shape)}")
    return shape


def _table(index: int, p: Mapping[str, Any]) -> nn.Module:
    from .tables import Table

    return Table(_int(p, "num_embeddings"), _int(p, "dim"), p["type"], mode=str(p.get("mode", "mean")),
                 sparse=bool(p.get("sparse", True)), init_std=float(p.get("init_std", 1.0)), name=f"{index}.weight",
                 seed=int(p.get("_seed", 0)), gathered=bool(p.get("_gathered", False)) and bool(p.get("sparse", True)))


def _build_one(index: int, in_shape: Shape, layers: Sequence[Mapping[str, Any]]) -> nn.Module:
    layer = layers[index]
    kind = layer.get("type")
    if kind in ("embedding", "embedding_bag"):
        if index:
            raise LayerError(index, f"{_describe(index, layers)} takes integer ids: it must be the first layer")
        return _table(index, layer)
    if kind not in LAYER_TYPES:
        raise LayerError(
            index,
            f"{_describe(index, layers)}: unknown layer type {kind!r}; "
            f"known types: {', '.join(sorted(LAYER_TYPES))}",
        )
    try:
        return LAYER_TYPES[kind](in_shape, layer)
    except _ShapeMismatch as exc:
        elements = f" ({math.prod(in_shape)} elements)" if "elements" in exc.expects else ""
        raise LayerShapeError(
            index,
            f"{_describe(index, layers)} expects {exc.expects} but receives {in_shape}{elements} "
            f"from {_describe(index - 1, layers)}" + (f"; {exc.hint}" if exc.hint else ""),
        ) from None
    except (ValueError, TypeError) as exc:
        # (torch's own errors carry a C++ backtrace after their first line: one line is the message)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LayerError(index, f"{_describe(index, layers)}: {message}") from None


_SAME_SHAPE = (nn.ReLU, nn.Tanh, nn.GELU, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Dropout,
               nn.BatchNorm1d, nn.LayerNorm)


def _known_shape(module: nn.Module, shape: Shape) -> Shape | None:
    """The output shape of the layers whose shape rule is plain, without running them: on the meta
    device their kernels come from torch's Python references, whose first call imports
    torch._dynamo and sympy (about 2 s of every validation)."""
    if isinstance(module, nn.Linear):
        return (*shape[:-1], module.out_features)
    if isinstance(module, _SAME_SHAPE):
        return shape
    if isinstance(module, nn.Flatten):
        return (math.prod(shape),)
    return None


def _walk(input_shape: Sequence[int], layers: Sequence[Mapping[str, Any]]) -> tuple[list[Shape], list[Shape]]:
    """Build every layer on the meta device; return (input shapes, output shapes)."""
    shape = _check_input_shape(input_shape)
    ins: list[Shape] = []
    outs: list[Shape] = []
    with torch.device("meta"):
        for i in range(len(layers)):
            module = _build_one(i, shape, layers).eval()
            quick = _known_shape(module, shape)
            if quick is not None:
                ins.append(shape)
                outs.append(shape := quick)
                continue
            try:
                out = module(torch.empty((2, *shape), device="meta"))
            except RuntimeError as exc:
                raise LayerShapeError(
                    i,
                    f"{_describe(i, layers)} cannot take input of shape {shape} "
                    f"from {_describe(i - 1, layers)}: {exc}",
                ) from None
            new = tuple(int(d) for d in out.shape[1:])
            if not new or any(d < 1 for d in new):
                raise LayerShapeError(
                    i,
                    f"{_describe(i, layers)} turns input of shape {shape} from "
                    f"{_describe(i - 1, layers)} into an empty shape {new}; "
                    "use a smaller kernel_size or add padding",
                )
            ins.append(shape)
            outs.append(new)
            shape = new
    return ins, outs


def infer_shapes(input_shape: Sequence[int], layers: Sequence[Mapping[str, Any]]) -> list[Shape]:
    """Output shape (without batch dim) after each layer, computed on the meta device.

    Nothing is allocated, so huge layers cost nothing.  Raises ``LayerShapeError``
    (``.index`` = offending layer) on a shape mismatch or an empty/negative output shape,
    ``LayerError`` for an unknown type or bad parameter, ``ValueError`` for a bad input shape.
    """
    return _walk(input_shape, layers)[1]


def build_layers(
    input_shape: Sequence[int],
    layers: Sequence[Mapping[str, Any]],
    device: str | torch.device = "cpu",
    seed: int | None = None,
    gathered_tables: bool = False,
) -> nn.Sequential:
    """Build ``nn.Sequential`` with one index per YAML layer (names ``0.weight``, ``0.bias``...).

    Shapes are checked on the meta device first; the real modules are then created on
    ``device`` (``"meta"`` builds a parameter-free skeleton).  With ``seed``, parameters
    are initialised on CPU by :func:`init_parameters` and then moved, so every process
    and every device gets identical weights.
    """
    ins, _ = _walk(input_shape, layers)
    # Tables (embedding layers) are seeded with the run's seed (their own generators) and, for a
    # replica, built gathered: no table, only the rows of each step (dtrain.model.tables).
    layers = [dict(layer, _seed=seed or 0, _gathered=gathered_tables) if layer.get("type") in
              ("embedding", "embedding_bag") else layer for layer in layers]
    target = torch.device(device)
    build_on = torch.device("cpu") if seed is not None and target.type != "meta" else target
    with torch.device(build_on):
        model = nn.Sequential(*[_build_one(i, ins[i], layers) for i in range(len(layers))])
    if seed is not None:
        init_parameters(model, seed)
    return model.to(target) if build_on != target else model


def output_shape(module: nn.Module, input_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Shape:
    """Output shape (without batch dim) of ``module`` for a batch of 2 inputs of ``input_shape``
    (of ``dtype``: int64 for ids).

    Free for modules on the meta device; otherwise runs a real forward in eval mode
    under ``torch.no_grad()``.
    """
    shape = _check_input_shape(input_shape)
    param = next(iter(module.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros((2, *shape), device=device, dtype=dtype))
    finally:
        module.train(was_training)
    return tuple(int(d) for d in out.shape[1:])


def check_output(output: Sequence[int], loss_name: str, num_classes: int | None = None) -> None:
    """Check that a model output shape (without batch dim) fits ``loss_name`` and 1-d targets.

    ``cross_entropy`` needs ``(C,)`` with C >= 2 and C >= ``num_classes`` when given;
    ``mse`` and ``bce_with_logits`` need ``(1,)`` or ``()`` (a module may return ``(batch,)``).
    Raises ``ValueError`` saying what to change.
    """
    shape = tuple(output)
    get_loss(loss_name)
    if loss_name == "cross_entropy":
        if len(shape) != 1:
            raise ValueError(
                f"cross_entropy needs the model to output (num_classes,) per sample but it outputs {shape}"
                + ("; add {type: flatten} and a linear layer at the end" if len(shape) > 1 else "")
            )
        need = max(2, num_classes or 0)
        if shape[0] < need:
            raise ValueError(
                f"cross_entropy needs at least {need} outputs per sample"
                + (f" for {num_classes} classes" if num_classes else "")
                + f" but the model outputs {shape}; set the last linear layer's out to {need}"
            )
    elif shape not in ((1,), ()):
        raise ValueError(
            f"{loss_name} needs the model to output one value per sample, (batch,) or (batch, 1), but it outputs "
            f"(batch, {', '.join(map(str, shape))}); end the layers with {{type: linear, out: 1}}, or return one "
            "value per sample from the module"
        )


# --------------------------------------------------------------------------- losses


def _regression_pair(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if target.dim() == 1 and output.dim() == 2 and output.shape[-1] == 1:
        output = output.squeeze(-1)
    return output, target.to(output.dtype if output.is_floating_point() else torch.float32)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(*_regression_pair(output, target))


def _bce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(*_regression_pair(output, target))


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target.long())


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOSSES: dict[str, LossFn] = {"cross_entropy": _cross_entropy, "mse": _mse, "bce_with_logits": _bce}
"""Loss name -> ``loss_fn(output, target)`` (mean reduction)."""


def get_loss(name: str) -> LossFn:
    """The loss function for ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(LOSSES)}") from None


def is_classification(loss_name: str) -> bool:
    """True for losses whose targets are class labels (``cross_entropy``, ``bce_with_logits``)."""
    get_loss(loss_name)
    return loss_name in ("cross_entropy", "bce_with_logits")


def predictions(output: torch.Tensor, loss_name: str) -> torch.Tensor:
    """Predicted class labels (int64) for a classification loss's model output."""
    if loss_name == "cross_entropy":
        return output.argmax(dim=-1)
    if loss_name == "bce_with_logits":
        if output.dim() == 2 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        return (output > 0).long()
    raise ValueError(f"loss {loss_name!r} is not a classification loss")


def accuracy(output: torch.Tensor, target: torch.Tensor, loss_name: str) -> float:
    """Fraction of correct predictions (classification losses only)."""
    pred = predictions(output, loss_name)
    if pred.shape != target.shape:
        target = target.reshape(pred.shape)
    return float((pred == target.long()).float().mean().item()) if target.numel() else 0.0


# --------------------------------------------------------------------------- parameters


def param_layout(module: nn.Module) -> list[tuple[str, Shape, int]]:
    """``(name, shape, numel)`` per parameter, in ``named_parameters()`` order (meta-safe)."""
    return [(name, tuple(p.shape), p.numel()) for name, p in module.named_parameters()]


def init_parameters(module: nn.Module, seed: int) -> nn.Module:
    """Deterministically re-initialise ``module``: seed, then ``reset_parameters()`` on every
    submodule that has it (in ``modules()`` order).  Same seed + same device type -> same
    weights in every process.  The global RNG state is left as it was.  Returns ``module``.
    """
    cuda = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.no_grad():
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    return module
