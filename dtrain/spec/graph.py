"""A graph pipeline's sections: variables held by ps tasks and operations run as Dask tasks.

Device scopes, as in the TF guide's ``with tf.device(replica_device_setter(...)):`` block (the
compiler resolves them, ``plan/compiler.py``): the default op device is worker task 0's CPU
(``/job:worker/task:0/device:CPU:0``; without a ``worker`` job, the first job's); an op's
``device`` is merged onto it, so a partial pin such as ``/task:1`` or ``/cpu:0`` keeps the
other fields (``/job:worker/task:1/device:CPU:0``). Variables without a ``job`` go round robin
over the ps job's tasks (``/task:1`` picks ps task 1); without a ``ps`` job they stay on the
default op device, like ``replica_device_setter(ps_tasks=0)``. ``device: none`` clears every
enclosing scope (``tf.device(None)``): the node takes no ps slot and runs on the session's task,
worker task 0's CPU.

Values are float32 numbers or nested lists, or strings (``value: "Hello"``: ``identity`` and
``add``, which concatenates as TF's ``add`` does on strings); a variable may instead name an
``initializer`` (TF1's ``*_initializer`` with a ``shape``).

Here: the section models, and the graph section's own rules (``graph_problems``), which take the
lists they check and the cluster's job names as arguments, so this module imports no other
section and never the pipeline that assembles it (``pipeline``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import MAX_SEED, NAME, Strict, check_device_string

Loc = tuple[str | int, ...]
CheckDevice = Callable[[Loc, str | None, str], None]
"""``check_device(loc, value, scope_job)``: the pipeline's check of a device pin against the cluster."""

MAX_INIT_ELEMENTS = 2**24  # 64 MiB of float32: a graph node is one Dask task's value


class InitializerSpec(Strict):
    """A variable's initial value drawn from a distribution (TF1's ``tf.*_initializer``, float32)."""

    type: Literal["zeros", "ones", "random_normal", "random_uniform", "truncated_normal"] = Field(
        description="zeros, ones, random_normal (mean, stddev), random_uniform (minval, maxval) or truncated_normal "
        "(mean, stddev; values beyond 2 stddev are drawn again, as TF does).")
    mean: float = Field(0.0, description="random_normal, truncated_normal: the mean (TF1's default 0).")
    stddev: float = Field(1.0, gt=0, description="random_normal, truncated_normal: the standard deviation (TF1's "
                          "default 1).")
    minval: float = Field(0.0, description="random_uniform: the lower bound, included (TF1's default 0).")
    maxval: float = Field(1.0, description="random_uniform: the upper bound, excluded (TF1's default 1).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of this initializer: the same seed gives the "
                             "same values. Default: derived from training.seed and the variable's name (dtrain runs "
                             "are reproducible; TF without a seed would draw new values each run).")

    @model_validator(mode="after")
    def _keys_of_type(self) -> InitializerSpec:
        keys = {"random_normal": {"mean", "stddev"}, "truncated_normal": {"mean", "stddev"},
                "random_uniform": {"minval", "maxval"}}.get(self.type, set()) | {"type", "seed"}
        extra = sorted(set(self.model_fields_set) - keys)
        if extra:
            raise ValueError(f"{', '.join(extra)} does not apply to a {self.type} initializer (it takes "
                             f"{', '.join(sorted(keys - {'type'}))}): remove it")
        if self.type == "random_uniform" and not self.minval < self.maxval:
            raise ValueError(f"random_uniform needs minval < maxval, got {self.minval} and {self.maxval}")
        return self

# ----------------------------------------------------------------------------------------- graph


class VariableSpec(Strict):
    """A variable of a graph section (a tensor held by a ps task)."""

    name: str = Field(pattern=NAME, description="Name used by graph inputs and fetch.")
    value: float | str | list[Any] | None = Field(
        None, description="Initial value: a number, a nested list of numbers, or a string (a string constant, "
        "e.g. 'Hello distributed TensorFlow!'). Give value or initializer.")
    initializer: InitializerSpec | None = Field(None, description="Draw the initial value instead, e.g. "
                                                "{type: random_normal, stddev: 0.1, seed: 1}; needs shape.")
    shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="With initializer: the variable's shape, e.g. [2, 2] ([] for a scalar).")
    device: str | None = Field(None, description="Where it lives, e.g. /job:ps/task:0 or /task:1 (a ps task); "
                               "default: ps round robin (no ps job: the default op device); none: no scope.")

    _device = field_validator("device")(classmethod(lambda cls, v: check_device_string(v, allow_clear=True)))

    @model_validator(mode="after")
    def _value_or_initializer(self) -> VariableSpec:
        if (self.value is None) == (self.initializer is None):
            raise ValueError("give exactly one of value (e.g. value: 1.0) and initializer (e.g. initializer: "
                             "{type: random_normal, seed: 1} with shape: [2, 2])")
        if self.initializer is not None and self.shape is None:
            raise ValueError("an initializer needs the variable's shape, e.g. shape: [2, 2] ([] for a scalar)")
        if self.initializer is None and self.shape is not None:
            raise ValueError("shape goes with initializer; a value gives its own shape: remove shape")
        numel = 1
        for d in self.shape or ():
            numel *= d
        if numel > MAX_INIT_ELEMENTS:
            raise ValueError(f"shape {self.shape} has {numel} elements; at most {MAX_INIT_ELEMENTS} (2**24) in a "
                             "graph variable")
        return self


GRAPH_OPS = ("add", "sub", "mul", "div", "matmul", "neg", "identity", "sum", "mean", "square", "sqrt", "relu",
             "exp", "maximum", "minimum", "pow")


class OpSpec(Strict):
    """An operation of a graph section, evaluated as one Dask task on its device."""

    name: str = Field(pattern=NAME, description="Name used by later inputs and fetch.")
    op: Literal[GRAPH_OPS] = Field(description="Operation: " + ", ".join(GRAPH_OPS) + ".")  # type: ignore[valid-type]
    inputs: list[str | float] = Field(default_factory=list, description="Variable/op names, or number literals.")
    device: str | None = Field(None, description="Where it runs, merged onto the default op device "
                               "/job:worker/task:0/device:CPU:0: e.g. /job:worker/task:1, /task:1, /cpu:0; "
                               "none: no enclosing scope (worker task 0's CPU).")

    _device = field_validator("device")(classmethod(lambda cls, v: check_device_string(v, allow_clear=True)))


_ARITY = {"add": 2, "sub": 2, "mul": 2, "div": 2, "matmul": 2, "maximum": 2, "minimum": 2, "pow": 2}
STRING_OPS = ("identity", "add")
"""The ops that take strings: identity, and add, which concatenates (TF's Add kernel on tf.string)."""


def graph_jobs(jobs: list[str], ps_job: str, worker_job: str) -> tuple[str | None, str]:
    """A graph pipeline's ps job (None when the cluster has none: variables then stay on the default
    op device, as ``replica_device_setter(ps_tasks=0)`` places nothing) and the job of the default
    op device (``placement.worker_job``, else the first job)."""
    return (ps_job if ps_job in jobs else None), (worker_job if worker_job in jobs else jobs[0])


def graph_problems(variables: list[VariableSpec], ops: list[OpSpec], fetch: list[str], *, jobs: list[str],
                   ps_job: str, worker_job: str, check_device: CheckDevice) -> list[tuple[Loc, str]]:
    """The graph section's rules: unique names, known inputs and fetches, arities, string ops, and
    devices (``check_device(loc, value, scope_job)``: a pin without a job is in ``scope_job``).

    Takes the sections it reads, the graph section's three lists and the cluster's job names with
    ``placement``'s ps and worker jobs, rather than the pipeline that runs it (``pipeline``)."""
    variable_job, op_job = graph_jobs(jobs, ps_job, worker_job)
    problems: list[tuple[Loc, str]] = []
    seen: dict[str, Loc] = {}
    strings: set[str] = set()  # the nodes whose value is a string
    for i, var in enumerate(variables):
        if var.name in seen:
            problems.append((("variables", i, "name"), f"duplicate name {var.name!r} "
                             f"(first at {'.'.join(map(str, seen[var.name]))})"))
        seen.setdefault(var.name, ("variables", i))
        if isinstance(var.value, str):
            strings.add(var.name)
        check_device(("variables", i, "device"), var.device, variable_job or op_job)
    for i, op in enumerate(ops):
        if op.name in seen:
            problems.append((("graph", i, "name"), f"duplicate name {op.name!r} "
                             f"(first at {'.'.join(map(str, seen[op.name]))})"))
        for j, inp in enumerate(op.inputs):
            if isinstance(inp, str) and inp not in seen:
                problems.append((("graph", i, "inputs", j), f"{inp!r} is not a variable or an earlier op; "
                                 f"known: {', '.join(seen) or 'none'}"))
            if isinstance(inp, float) and not math.isfinite(inp):
                problems.append((("graph", i, "inputs", j), "literal must be finite"))
        want = _ARITY.get(op.op, 1)
        if len(op.inputs) != want:
            problems.append((("graph", i, "inputs"), f"op {op.op!r} takes {want} input(s), got {len(op.inputs)}"))
        text = [inp for inp in op.inputs if isinstance(inp, str) and inp in strings]
        if text and op.op not in STRING_OPS:
            problems.append((("graph", i, "op"), f"{op.op} takes numbers, but {text[0]!r} is a string; strings "
                             f"take {' and '.join(STRING_OPS)} (which concatenates)"))
        elif text and len(text) != len(op.inputs):
            problems.append((("graph", i, "inputs"), f"{op.op} mixes the string {text[0]!r} with a number; "
                             "add concatenates two strings (TF refuses string + number too)"))
        elif text:
            strings.add(op.name)
        seen.setdefault(op.name, ("graph", i))
        check_device(("graph", i, "device"), op.device, op_job)
    for i, name in enumerate(fetch):
        if name not in seen:
            problems.append((("fetch", i), f"{name!r} is not a variable or op; known: {', '.join(seen) or 'none'}"))
    return problems


def initial_value(var: VariableSpec, training_seed: int) -> Any:
    """What a variable's node evaluates: its value, or ``{"initializer": {...}, "shape": [...]}`` with the
    seed resolved (an unseeded initializer: from training.seed and the name, so runs repeat; pure)."""
    if var.initializer is None:
        return var.value
    init = var.initializer.model_dump()
    if init["seed"] is None:
        digest = hashlib.sha256(f"{training_seed}/{var.name}".encode()).digest()
        init["seed"] = int.from_bytes(digest[:4], "little")
    return {"initializer": init, "shape": list(var.shape or ())}
