"""A pipeline's model as a ``torch.nn.Module``: layers from ``model.layers``, or a custom
``nn.Module`` class or factory by import path (``model.module``), initialised from a seed, and
built for free on torch's meta device when only the parameter layout is needed (planning).

Pure torch: no Dask; the spec is read, never imported from.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .layers import NotAModuleError, build_layers, init_parameters
from .recommendation import build_dlrm, feed_features
from .tables import swap_embeddings


def import_object(path: str) -> Any:
    """Resolve ``"pkg.mod:attr"`` (attr may be dotted) or ``"pkg.mod.attr"`` to an object.

    Raises ``ValueError`` for a malformed path and ``ImportError`` when the module or
    attribute cannot be found.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"import path must be a non-empty string like 'pkg.mod:attr', got {path!r}")
    path = path.strip()
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr or ":" in attr or any(not part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"import path {path!r} must look like 'pkg.mod:attr' or 'pkg.mod.attr'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {mod_name!r} for {path!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{path!r}: {mod_name!r} has no attribute {attr!r}") from None
    return obj


def build_custom(
    module_path: str,
    kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> nn.Module:
    """Call the ``nn.Module`` class or factory at ``module_path`` with ``kwargs``.

    Construction runs under ``torch.device(device)`` (``"meta"`` gives a free skeleton
    for planning) and, with ``seed``, under a seeded RNG followed by
    :func:`init_parameters`.  Raises ``NotAModuleError`` (a TypeError and ValueError)
    when the result is not an ``nn.Module``; errors raised by the factory propagate
    wrapped in a ``TypeError`` naming the path.
    """
    factory = import_object(module_path)
    if not callable(factory):
        raise NotAModuleError(f"{module_path!r} is not callable (got {type(factory).__name__})")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            module = factory(**dict(kwargs or {}))
        except TypeError as exc:
            raise TypeError(f"calling {module_path}(**{dict(kwargs or {})!r}) failed: {exc}") from exc
    if not isinstance(module, nn.Module):
        raise NotAModuleError(f"{module_path!r} returned {type(module).__name__}, not a torch.nn.Module")
    if seed is not None and torch.device(device).type != "meta":
        init_parameters(module, seed)
    return module


# --------------------------------------------------------------------------- from a spec


class _Section(Protocol):
    def model_dump(self) -> dict[str, Any]: ...


class ModelSection(Protocol):
    """What the builders read of a pipeline's ``model`` section (``dtrain.spec``'s ``ModelSpec``;
    the model plane never imports the spec, which imports it for shape inference)."""

    @property
    def input_shape(self) -> Sequence[int] | None: ...
    @property
    def layers(self) -> Sequence[_Section] | None: ...
    @property
    def module(self) -> str | None: ...
    @property
    def kwargs(self) -> Mapping[str, Any]: ...
    @property
    def features(self) -> _Section | None: ...
    @property
    def tables(self) -> Mapping[str, _Section] | None: ...
    @property
    def dlrm(self) -> _Section | None: ...


class _Seeded(Protocol):
    @property
    def seed(self) -> int: ...


class ModelPipeline(Protocol):
    """What the builders read of a ``dtrain.PipelineSpec`` (or of a replica's job description,
    ``dtrain.plan.job.ReplicaJob``): its ``model`` section (None: a graph pipeline)."""

    @property
    def model(self) -> ModelSection | None: ...


@runtime_checkable
class SeededPipeline(ModelPipeline, Protocol):
    """A pipeline with its ``training.seed``: the seed :func:`build_model` uses when given none."""

    @property
    def training(self) -> _Seeded: ...


def _model_section(spec: ModelPipeline) -> ModelSection:
    model = spec.model
    if model is None:
        raise ValueError("this pipeline has no 'model' section (it is a graph pipeline)")
    return model


def _recommendation(model: ModelSection) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """A ``model`` section's features, tables and dlrm, as the builder's plain dicts."""
    if model.features is None or model.tables is None or model.dlrm is None:  # (validation sees to it)
        raise ValueError("model.dlrm needs model.features and model.tables")
    return (model.features.model_dump(), {name: t.model_dump() for name, t in model.tables.items()},
            model.dlrm.model_dump())


def _layers(model: ModelSection) -> tuple[Sequence[int], list[dict[str, Any]]]:
    """A ``model.layers`` section's input shape and layers, as the builder's plain values."""
    if model.input_shape is None or model.layers is None:  # (validation sees to it)
        raise ValueError("model.layers needs model.input_shape")
    return model.input_shape, [layer.model_dump() for layer in model.layers]


def _module(model: ModelSection) -> str:
    if model.module is None:  # (validation sees to it)
        raise ValueError("the model section names none of model.layers, model.module and model.dlrm")
    return model.module


def build_model(spec: ModelPipeline, device: str | torch.device = "cpu", seed: int | None = None,
                gathered_tables: bool = False) -> nn.Module:
    """The pipeline's model (a ``dtrain.PipelineSpec``), initialised with ``training.seed`` unless
    ``seed`` is given. ``torch.load("runs/NAME/model.pt", weights_only=True)`` loads into it.
    ``gathered_tables``: sparse embedding tables are built without their rows (a replica's model,
    ``dtrain.model.tables``); by default they are built whole (the initial table the ps holds)."""
    model = _model_section(spec)
    if seed is None:
        if not isinstance(spec, SeededPipeline):
            raise ValueError("build_model needs seed= for a model section without training settings")
        seed = spec.training.seed
    if model.dlrm is not None:
        return build_dlrm(*_recommendation(model), device, seed=seed, gathered_tables=gathered_tables)
    if model.layers is not None:
        return build_layers(*_layers(model), device, seed=seed, gathered_tables=gathered_tables)
    module = build_custom(_module(model), model.kwargs, device, seed=seed)
    swap_embeddings(module, seed=seed or 0, gathered=gathered_tables)  # its sparse embeddings: ps tables
    if model.features is not None:  # it takes packed records: dense and per-feature ids
        feed_features(module, model.features.model_dump())
    return module


def build_model_skeleton(spec: ModelPipeline) -> nn.Module:
    """The model on torch's meta device: names and shapes of parameters, no storage."""
    model = _model_section(spec)
    if model.dlrm is not None:
        return build_dlrm(*_recommendation(model), "meta")
    if model.layers is not None:
        return build_layers(*_layers(model), "meta")
    module = build_custom(_module(model), model.kwargs, "meta")
    swap_embeddings(module)
    if model.features is not None:  # (its features' tables checked: ValueError naming the feature)
        feed_features(module, model.features.model_dump())
    return module
