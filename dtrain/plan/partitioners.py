"""TensorFlow's variable partitioners and partitioned-variable slicing, as pure functions.

A partitioner maps a variable's shape and element size to its partition vector: the number of
parts along each axis, 1 everywhere but the split axis (``python/ops/partitioned_variables.py``):

- ``fixed_size``: ``min(num_shards, dim[axis])``;
- ``min_max``: ``max(1, min(dim[axis], max_partitions, ceil(total_bytes / min_slice_size)))``;
- ``variable_axis_size``: ``ceil(dim[axis] / max(1, floor(max_shard_bytes / bytes_per_slice)))``
  with ``bytes_per_slice = numel / dim[axis] * itemsize``, capped by ``max_shards``.

Each raises ValueError for an axis the shape does not have, as TensorFlow does. :func:`slice_variable`
cuts the variable as ``variable_scope._get_partitioned_variable`` does: every part gets
``dim // n`` slices of the axis and the first ``dim % n`` one more (43 columns in 3: 15, 14, 14),
named ``<name>/part_<i>`` and each placed as a variable of its own (round robin or greedy).

A part along axis A of a shape ``(..., D, ...)`` is ``outer = prod(dims before A)`` blocks of
``len * inner`` consecutive elements of the flattened variable (``inner = prod(dims after A)``),
``D * inner`` apart: ``start``/``blocks``/``stride`` (plan/layout.py copies it with one strided view).
Along axis 0 (or when every dim before A is 1) a part is one contiguous range, ``blocks == 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dtrain.spec.partitioner import PartitionerSpec

from .placement import VariableRequest, names_variable

DEFAULT_MIN_SLICE_SIZE = 256 * 1024


def _check_axis(shape: Sequence[int], axis: int, what: str) -> None:
    if not 0 <= axis < len(shape):
        raise ValueError(f"{what}: cannot partition a variable of shape {list(shape)} along axis {axis} "
                         f"(it has {len(shape)} dimension(s))")


def fixed_size(shape: Sequence[int], num_shards: int, axis: int = 0) -> list[int]:
    """``fixed_size_partitioner(num_shards, axis)``: ``min(num_shards, dim[axis])`` parts."""
    _check_axis(shape, axis, "fixed_size")
    if num_shards < 1:
        raise ValueError(f"fixed_size: num_shards must be at least 1, got {num_shards}")
    out = [1] * len(shape)
    out[axis] = min(num_shards, shape[axis])
    return out


def min_max(shape: Sequence[int], itemsize: int, max_partitions: int = 1, axis: int = 0,
            min_slice_size: int = DEFAULT_MIN_SLICE_SIZE) -> list[int]:
    """``min_max_variable_partitioner``: as many parts as keep each at least ``min_slice_size``
    bytes, at most ``max_partitions`` and at most ``dim[axis]``, at least one."""
    _check_axis(shape, axis, "min_max")
    total_bytes = math.prod(shape) * itemsize
    out = [1] * len(shape)
    out[axis] = max(1, min(shape[axis], max_partitions, math.ceil(total_bytes / min_slice_size)))
    return out


def variable_axis_size(shape: Sequence[int], itemsize: int, max_shard_bytes: int, axis: int = 0,
                       max_shards: int | None = None) -> list[int]:
    """``variable_axis_size_partitioner``: parts of whole slices of ``axis``, each under
    ``max_shard_bytes`` where a slice allows it (a part holds at least one slice)."""
    _check_axis(shape, axis, "variable_axis_size")
    if max_shard_bytes < 1:
        raise ValueError(f"variable_axis_size: max_shard_bytes must be at least 1, got {max_shard_bytes}")
    if max_shards is not None and max_shards < 1:
        raise ValueError(f"variable_axis_size: max_shards must be at least 1, got {max_shards}")
    bytes_per_slice = math.prod(shape) / shape[axis] * itemsize
    slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
    shards = math.ceil(shape[axis] / slices_per_shard)
    out = [1] * len(shape)
    out[axis] = min(max_shards, shards) if max_shards else shards
    return out


def partitions_for(config: PartitionerSpec | dict[str, Any], shape: Sequence[int], itemsize: int) -> list[int]:
    """The partition vector of ``placement.partitioner`` (a spec model or a dict with its keys)."""
    c = config if isinstance(config, dict) else config.model_dump()
    if c["type"] == "fixed_size":
        return fixed_size(shape, c["num_shards"], c.get("axis", 0))
    if c["type"] == "min_max":
        return min_max(shape, itemsize, c.get("max_partitions", 1), c.get("axis", 0),
                       c.get("min_slice_size", DEFAULT_MIN_SLICE_SIZE))
    if c["type"] == "variable_axis_size":
        return variable_axis_size(shape, itemsize, c["max_shard_bytes"], c.get("axis", 0), c.get("max_shards"))
    raise ValueError(f"unknown partitioner type {c['type']!r}; use fixed_size, min_max or variable_axis_size")


def partition(name: str, shape: tuple[int, ...], itemsize: int, num_parts: int) -> list[VariableRequest]:
    """Split along dim 0 into ``min(num_parts, shape[0])`` parts; the first ``dim0 % n`` parts get a row more."""
    if not shape:
        raise ValueError(f"cannot partition {name!r}: a scalar has no dimension 0")
    if num_parts < 1:
        raise ValueError(f"cannot partition {name!r} into {num_parts} parts; need at least 1")
    return slice_variable(name, shape, itemsize, [max(1, min(num_parts, shape[0])), *[1] * (len(shape) - 1)])


def slice_variable(name: str, shape: Sequence[int], itemsize: int, partitions: Sequence[int]) -> list[VariableRequest]:
    """The parts of a variable for a partition vector (one axis > 1), in order, each with its slice
    of the flattened variable (``start``, ``blocks``, ``stride``) and TensorFlow's save-slice spec
    (``"20 43 0,20:15,14"``: full shape, then ``start,length`` per dimension)."""
    shape = tuple(int(d) for d in shape)
    if len(partitions) != len(shape) or any(p < 1 for p in partitions):
        raise ValueError(f"cannot partition {name!r}: partitions {list(partitions)} do not fit shape {list(shape)}")
    split = [a for a, p in enumerate(partitions) if p > 1]
    if len(split) > 1:
        raise ValueError(f"cannot partition {name!r} along several axes {split}: only one axis may be split")
    axis = split[0] if split else 0
    n = partitions[axis] if split else 1
    dim = shape[axis]
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    base, extra = divmod(dim, n)
    parts, offset = [], 0
    for i in range(n):
        length = base + (1 if i < extra else 0)
        part_shape = (*shape[:axis], length, *shape[axis + 1:])
        numel = outer * length * inner
        spec = " ".join(map(str, shape)) + " " + ":".join(
            f"{offset},{length}" if a == axis else f"0,{d}" for a, d in enumerate(shape))
        parts.append(VariableRequest(f"{name}/part_{i}", part_shape, numel * itemsize, source=name,
                                     start=offset * inner, axis=axis, blocks=outer if outer > 1 else 1,
                                     stride=dim * inner if outer > 1 else 0, slice_spec=spec))
        offset += length
    return parts


def _splittable(shape: Sequence[int], axis: int) -> bool:
    """A variable with ``axis`` and at least two elements (else it stays whole)."""
    return len(shape) > axis and math.prod(shape) >= 2


def _selected(config: PartitionerSpec, name: str) -> bool:
    return not config.variables or any(names_variable(key, name) for key in config.variables)


def partition_of(config: PartitionerSpec | None, name: str, shape: Sequence[int], itemsize: int) -> list[VariableRequest] | None:
    """The parts of a dense variable under ``placement.partitioner`` (None: it stays whole): a
    variable the partitioner selects, with the partitioner's axis and at least two elements, whose
    partition vector splits it into two or more parts."""
    if config is None or not _selected(config, name) or not _splittable(shape, config.axis):
        return None
    partitions = partitions_for(config, shape, itemsize)
    if max(partitions) < 2:
        return None
    return slice_variable(name, shape, itemsize, partitions)


def check_partitioner(config: PartitionerSpec | None, layout: Sequence[tuple[str, tuple[int, ...], int]], pinned: set[str]) -> None:
    """SpecError for ``placement.partitioner.variables`` entries that name no variable, or name one
    that cannot be split: pinned (variable_devices), a single element, or without the axis."""
    if config is None or not config.variables:
        return
    from dtrain.spec.errors import Problem, SpecError

    shapes = {name: shape for name, shape, _ in layout}
    problems = []
    for i, key in enumerate(config.variables):
        path = f"placement.partitioner.variables.{i}"
        matched = [n for n in shapes if names_variable(key, n)]
        if not matched:
            problems.append(Problem(f"{key!r} names no dense variable of the model (variables: {', '.join(shapes)}; "
                                    "a prefix must end with '.')", path=path))
        elif key in shapes and key in pinned:
            problems.append(Problem(f"{key!r} is pinned by placement.variable_devices, and a pinned variable is "
                                    "never partitioned: remove it from one of the two", path=path))
        elif key in shapes and not _splittable(shapes[key], config.axis):
            problems.append(Problem(f"{key!r} has shape {list(shapes[key])}: it cannot be split along axis "
                                    f"{config.axis}; remove it, or use another placement.partitioner.axis", path=path))
    if problems:
        raise SpecError(problems)
