"""``placement.partitioner``: TensorFlow's variable partitioners (``tf.compat.v1`` ``fixed_size_partitioner``,
``min_max_variable_partitioner``, ``variable_axis_size_partitioner``), one of three shapes told apart by
``type``. The arithmetic lives in ``dtrain.plan.partitioners``; docs/pipeline.md describes the behaviour."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .base import Strict

_AXIS = "The axis to split along (0: rows). A variable with no such axis is kept whole."
_VARIABLES = ("Which dense variables to partition: names (torch's named_parameters()) or prefixes ending in '.'; "
              "empty: every variable with at least two elements. Pinned variables (variable_devices) are never split.")


class _Partitioner(Strict):
    """What every partitioner has: the axis and the variables it splits."""

    axis: int = Field(0, ge=0, description=_AXIS)
    variables: list[str] = Field(default_factory=list, description=_VARIABLES)


class FixedSizePartitioner(_Partitioner):
    """tf.compat.v1.fixed_size_partitioner: a fixed number of parts."""

    type: Literal["fixed_size"] = Field(description="fixed_size_partitioner: min(num_shards, dim[axis]) parts.")
    num_shards: int = Field(ge=1, description="Parts per variable (capped by the size of the axis).")


class MinMaxPartitioner(_Partitioner):
    """tf.compat.v1.min_max_variable_partitioner: parts of at least min_slice_size bytes, at most max_partitions."""

    type: Literal["min_max"] = Field(
        description="min_max_variable_partitioner: max(1, min(dim[axis], max_partitions, ceil(bytes / min_slice_size))).")
    max_partitions: int = Field(1, ge=1, description="At most this many parts per variable.")
    min_slice_size: int = Field(256 * 1024, ge=1, description="Bytes: each part holds at least about this much "
                                "(TensorFlow's default 256 KiB).")


class VariableAxisSizePartitioner(_Partitioner):
    """tf.compat.v1.variable_axis_size_partitioner: parts of at most max_shard_bytes (whole slices of the axis)."""

    type: Literal["variable_axis_size"] = Field(
        description="variable_axis_size_partitioner: as many parts as keep each under max_shard_bytes (a part "
        "holds at least one slice of the axis).")
    max_shard_bytes: int = Field(ge=1, description="Bytes: the most one part should hold.")
    max_shards: int | None = Field(None, ge=1, description="Cap on the number of parts (none: no cap).")


PartitionerSpec = Annotated[FixedSizePartitioner | MinMaxPartitioner | VariableAxisSizePartitioner,
                            Field(discriminator="type")]
