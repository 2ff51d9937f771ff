"""dtrain: Distributed TensorFlow's parameter-server architecture for PyTorch, on Dask.

Public API (docs/api.md): ``load``, ``PipelineSpec``, ``compile``, ``run``, ``build_model``,
``DeviceSpec``, ``Hook``, ``adapt``. Heavy modules (torch, dask) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import Aborted, OutOfRange, RunError, TransientError, Unavailable
from .spec.device import DeviceSpec
from .spec.errors import SpecError
from .spec.loading import load, loads
from .spec.pipeline import PipelineSpec

__version__ = "0.1.0"

__all__ = [
    "Aborted", "DeviceSpec", "Hook", "OutOfRange", "PipelineSpec", "RunError", "SpecError", "TransientError",
    "Unavailable", "__version__", "adapt", "build_model", "compile", "load", "loads", "run",
]

_LAZY = {
    "compile": ("dtrain.plan.compiler", "compile"),
    "build_model": ("dtrain.model.build", "build_model"),
    "run": ("dtrain.chief.runner", "run"),
    "adapt": ("dtrain.deploy.adaptive", "adapt"),
    "Hook": ("dtrain.chief.hooks", "Hook"),
}

if TYPE_CHECKING:  # pragma: no cover
    from .chief.hooks import Hook
    from .chief.runner import run
    from .deploy.adaptive import adapt
    from .model.build import build_model
    from .plan.compiler import compile


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
