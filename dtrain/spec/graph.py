"""A graph pipeline's sections: variables held by ps tasks and operations run as Dask tasks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .sections import NAME, Strict, check_device_string

# ----------------------------------------------------------------------------------------- graph


class VariableSpec(Strict):
    """A variable of a graph section (a tensor held by a ps task)."""

    name: str = Field(pattern=NAME, description="Name used by graph inputs and fetch.")
    value: float | list[Any] = Field(description="Initial value: a number or a nested list.")
    device: str | None = Field(None, description="Where it lives, e.g. /job:ps/task:0 (default: ps round robin).")

    _device = field_validator("device")(classmethod(lambda cls, v: check_device_string(v)))


GRAPH_OPS = ("add", "sub", "mul", "div", "matmul", "neg", "identity", "sum", "mean", "square", "sqrt", "relu",
             "exp", "maximum", "minimum", "pow")


class OpSpec(Strict):
    """An operation of a graph section, evaluated as one Dask task on its device."""

    name: str = Field(pattern=NAME, description="Name used by later inputs and fetch.")
    op: Literal[GRAPH_OPS] = Field(description="Operation: " + ", ".join(GRAPH_OPS) + ".")  # type: ignore[valid-type]
    inputs: list[str | float] = Field(default_factory=list, description="Variable/op names, or number literals.")
    device: str | None = Field(None, description="Where it runs, e.g. /job:worker/task:1 (default: worker task 0).")

    _device = field_validator("device")(classmethod(lambda cls, v: check_device_string(v)))


_ARITY = {"add": 2, "sub": 2, "mul": 2, "div": 2, "matmul": 2, "maximum": 2, "minimum": 2, "pow": 2}
