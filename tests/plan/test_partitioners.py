"""TensorFlow's partitioners (plan/partitioners.py) against the expected values of
tf-semantics.md rows P1-P14 (``partitioned_variables_test.py``), and their use by the compiler."""

from __future__ import annotations

import pytest

import dtrain
from dtrain.plan.partitioners import fixed_size, min_max, partitions_for, slice_variable, variable_axis_size
from dtrain.spec.errors import SpecError

KIB = 1024
F32, I64 = 4, 8
AXIS_SIZE_VAR = (4, 8, 16, 32)  # rows P9-P12: a float32 variable of this shape


def test_p1_fixed_size_5_on_10x10():
    parts = fixed_size((10, 10), 5)
    assert parts == [5, 1]
    assert [p.shape for p in slice_variable("v", (10, 10), F32, parts)] == [(2, 10)] * 5


def test_p2_fixed_size_4_on_int64_vector():
    """dtrain's trainable variables are float32; the arithmetic still takes an int64's 8 bytes."""
    parts = fixed_size((20,), 4)
    assert parts == [4]
    sliced = slice_variable("v", (20,), I64, parts)
    assert [p.shape for p in sliced] == [(5,)] * 4 and [p.nbytes for p in sliced] == [5 * I64] * 4
    # min_max counts the int64's bytes: 160 bytes in slices of at least 40 -> 4 (32 with float32 -> 4 too,
    # but 48-byte slices tell the itemsizes apart: ceil(160/48) = 4 against ceil(80/48) = 2)
    assert min_max((20,), I64, 100, min_slice_size=48) == [4]
    assert min_max((20,), F32, 100, min_slice_size=48) == [2]


def test_p3_min_max_2kib_slices_of_8kib():
    assert min_max((2048,), F32, max_partitions=100, min_slice_size=2 * KIB) == [4]


def test_p4_min_max_256kib_slices_of_8mib():
    assert min_max((2048, 1024), F32, 100, min_slice_size=256 * KIB) == [32, 1]


@pytest.mark.parametrize(("max_partitions", "expected"), [(16, [16, 1]), (1, [1, 1])])
def test_p5_min_max_capped_by_max_partitions(max_partitions, expected):
    assert min_max((2048, 1024), F32, max_partitions, min_slice_size=256 * KIB) == expected


@pytest.mark.parametrize(("min_slice", "expected"), [(128 * KIB, [64, 1]), (512 * KIB, [16, 1])])
def test_p6_min_max_by_min_slice_size(min_slice, expected):
    assert min_max((2048, 1024), F32, 100, min_slice_size=min_slice) == expected


@pytest.mark.parametrize(("axis", "expected"), [(1, [1, 3, 1, 1]), (3, [1, 1, 1, 3])])
def test_p7_min_max_on_an_inner_axis_capped_by_its_dim(axis, expected):
    assert min_max((64, 1024, 1, 3), F32, 100, axis=axis, min_slice_size=256 * KIB) == expected


@pytest.mark.parametrize(("shape", "expected"), [((16, 128, 1024), [16, 1, 1]), ((4, 512, 1024), [4, 1, 1])])
def test_p8_min_max_capped_by_dim_0(shape, expected):
    assert min_max(shape, F32, 100, min_slice_size=256 * KIB) == expected


def test_p9_axis_size_fits_in_one_shard():
    assert variable_axis_size(AXIS_SIZE_VAR, F32, max_shard_bytes=131072, axis=0) == [1, 1, 1, 1]


def test_p10_axis_size_on_axis_2():
    assert variable_axis_size(AXIS_SIZE_VAR, F32, 32768, axis=2) == [1, 1, 2, 1]


@pytest.mark.parametrize("max_shard_bytes", [2048, 1024])  # 1024 < one slice: still one slice per shard
def test_p11_axis_size_one_slice_per_shard(max_shard_bytes):
    assert variable_axis_size(AXIS_SIZE_VAR, F32, max_shard_bytes, axis=3) == [1, 1, 1, 32]


def test_p12_axis_size_capped_by_max_shards():
    assert variable_axis_size(AXIS_SIZE_VAR, F32, 1024, axis=3, max_shards=2) == [1, 1, 1, 2]


def test_p13_slicing_43_columns_in_3():
    parts = slice_variable("w", (20, 43), F32, [1, 3])
    assert [p.shape for p in parts] == [(20, 15), (20, 14), (20, 14)]
    assert [p.slice_spec for p in parts] == ["20 43 0,20:0,15", "20 43 0,20:15,14", "20 43 0,20:29,14"]
    # Each part: 20 runs (one per row) of its columns, 43 elements apart, from its first column.
    assert [(p.start, p.blocks, p.stride, p.axis) for p in parts] == [(0, 20, 43, 1), (15, 20, 43, 1),
                                                                     (29, 20, 43, 1)]
    assert [p.name for p in parts] == ["w/part_0", "w/part_1", "w/part_2"]


def test_p14_slicing_13_rows_in_3():
    parts = slice_variable("w", (13, 5), F32, [3, 1])
    assert [p.shape for p in parts] == [(5, 5), (4, 5), (4, 5)]
    assert [p.slice_spec for p in parts] == ["13 5 0,5:0,5", "13 5 5,4:0,5", "13 5 9,4:0,5"]
    assert [(p.start, p.blocks, p.stride) for p in parts] == [(0, 1, 0), (25, 1, 0), (45, 1, 0)]


@pytest.mark.parametrize("fn", [lambda s: fixed_size(s, 2, axis=2), lambda s: min_max(s, F32, 4, axis=2),
                                lambda s: variable_axis_size(s, F32, 64, axis=2)])
def test_an_axis_the_shape_lacks_is_a_value_error(fn):
    with pytest.raises(ValueError, match="along axis 2"):
        fn((4, 4))


def test_partitions_for_reads_the_spec_section():
    assert partitions_for({"type": "min_max", "max_partitions": 100, "min_slice_size": 2 * KIB}, (2048,), F32) == [4]
    assert partitions_for({"type": "variable_axis_size", "max_shard_bytes": 1024, "axis": 3, "max_shards": 2},
                          AXIS_SIZE_VAR, F32) == [1, 1, 1, 2]


# ------------------------------------------------------------------------------------- compiler

SPEC = """
name: parts
cluster: {{jobs: {{ps: {ps}, worker: 1}}}}
model:
  input_shape: [43]
  layers: [{{type: linear, out: 20}}, {{type: relu}}, {{type: linear, out: 3}}]
placement: {placement}
data: {{source: synthetic, num_samples: 64, num_classes: 3, batch_size: 8}}
"""


def _plan(placement: str, ps: int = 2):
    return dtrain.compile(dtrain.loads(SPEC.format(ps=ps, placement=placement), base_dir="."))


def test_more_parts_than_ps_tasks_go_round_robin():
    plan = _plan("{partitioner: {type: fixed_size, num_shards: 3, axis: 1}}")
    rows = [(v.name, v.shape, v.device.split("/device")[0], v.slice_spec) for v in plan.variables]
    assert rows == [
        ("0.weight/part_0", (20, 15), "/job:ps/task:0", "20 43 0,20:0,15"),
        ("0.weight/part_1", (20, 14), "/job:ps/task:1", "20 43 0,20:15,14"),
        ("0.weight/part_2", (20, 14), "/job:ps/task:0", "20 43 0,20:29,14"),
        ("0.bias", (20,), "/job:ps/task:1", ""),  # rank 1: no axis 1, kept whole
        ("2.weight/part_0", (3, 7), "/job:ps/task:0", "3 20 0,3:0,7"),
        ("2.weight/part_1", (3, 7), "/job:ps/task:1", "3 20 0,3:7,7"),
        ("2.weight/part_2", (3, 6), "/job:ps/task:0", "3 20 0,3:14,6"),
        ("2.bias", (3,), "/job:ps/task:1", ""),
    ]
    assert [s.numel for s in plan.shards] == [300 + 280 + 21 + 18, 280 + 20 + 21 + 3]
    assert "axis 1 slice '20 43 0,20:15,14'" in plan.format()


def test_the_count_does_not_follow_the_ps_tasks():
    plan = _plan("{partitioner: {type: min_max, max_partitions: 5, min_slice_size: 1024}}", ps=1)
    # 0.weight: 3440 B -> ceil(3440/1024) = 4 parts, all on the one ps task; 0.bias 80 B -> 1 (whole)
    assert [v.name for v in plan.variables if v.source == "0.weight"] == [f"0.weight/part_{i}" for i in range(4)]
    assert {v.device for v in plan.variables} == {"/job:ps/task:0/device:CPU:0"}
    assert [v.name for v in plan.variables if v.source == "0.bias"] == ["0.bias"]


def test_greedy_places_the_parts_and_a_filter_picks_the_variables():
    plan = _plan("{variables: greedy, partitioner: {type: fixed_size, num_shards: 4, variables: ['0.weight']}}", ps=3)
    parts = [v for v in plan.variables if v.source == "0.weight"]
    assert [v.shape for v in parts] == [(5, 43)] * 4
    # greedy by bytes: 860 B parts to tasks 0, 1, 2, then the least loaded (0); 0.bias (80 B) to 1
    # (loads 1720, 940, 860), 2.weight (240 B) to 2 (1100), 2.bias to 1
    assert [v.device.split("/device")[0][-1] for v in plan.variables] == ["0", "1", "2", "0", "1", "2", "1"]
    assert [v.name for v in plan.variables if v.source == "2.weight"] == ["2.weight"]


def test_a_pinned_variable_stays_whole():
    plan = _plan("{partitioner: {type: fixed_size, num_shards: 2}, variable_devices: {'0.weight': /job:ps/task:1}}")
    assert [v.name for v in plan.variables if v.source == "0.weight"] == ["0.weight"]
    assert [v.name for v in plan.variables if v.source == "2.weight"] == ["2.weight/part_0", "2.weight/part_1"]


@pytest.mark.parametrize(("placement", "message"), [
    ("{partitioner: {type: fixed_size, num_shards: 2, variables: ['3.weight']}}",
     "placement.partitioner.variables.0: '3.weight' names no dense variable of the model"),
    ("{partitioner: {type: fixed_size, num_shards: 2, axis: 1, variables: ['0.bias']}}",
     r"placement.partitioner.variables.0: '0.bias' has shape \[20\]: it cannot be split along axis 1"),
    ("{partitioner: {type: fixed_size, num_shards: 2, variables: ['0.weight']}, "
     "variable_devices: {'0.weight': /job:ps/task:1}}",
     "placement.partitioner.variables.0: '0.weight' is pinned by placement.variable_devices"),
])
def test_a_filter_that_cannot_apply_is_refused(placement, message):
    with pytest.raises(SpecError, match=message):
        _plan(placement)


@pytest.mark.parametrize(("placement", "message"), [
    ("{variables: partitioned, partitioner: {type: fixed_size, num_shards: 2}}",
     "placement.variables: 'partitioned' splits by min_slice_bytes and cannot be combined with placement.partitioner"),
    ("{min_slice_bytes: 64, partitioner: {type: fixed_size, num_shards: 2}}",
     "placement.min_slice_bytes: applies to variables: partitioned only"),
    ("{partitioner: {type: fixed, num_shards: 2}}",
     "placement.partitioner.type: unknown partitioner type 'fixed'; did you mean 'fixed_size'"),
    ("{partitioner: {type: min_max, max_partition: 2}}",
     "placement.partitioner.max_partition: unknown key 'max_partition'; did you mean 'max_partitions'"),
    ("{partitioner: {type: variable_axis_size}}",
     "placement.partitioner.max_shard_bytes: missing required key 'max_shard_bytes'"),
])
def test_contradictory_or_bad_sections_name_the_key(placement, message):
    with pytest.raises(SpecError, match=message):
        dtrain.loads(SPEC.format(ps=2, placement=placement), base_dir=".")
