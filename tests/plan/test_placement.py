"""Tests for dtrain.placement, pinning tf.compat.v1.train.replica_device_setter's behaviour.

TF reference (tensorflow/python/training/device_setter.py): ``_ReplicaDeviceChooser.device_function``
asks the strategy for a task only when the op has no job or the ps job, then merges the op's own
device over ``/job:ps/task:<chosen>``; ``_RoundRobinStrategy`` cycles ``next_task``;
``GreedyLoadBalancingStrategy`` takes ``argmin`` of the loads (first minimum: lowest task) and adds
``byte_size_load_fn``; ``fixed_size_partitioner`` + the partitioned-variable slicing give
``min(num_shards, dim0)`` parts, the first ``dim0 % n`` one row longer, named ``<name>/part_<i>``.
"""

from __future__ import annotations

import pytest

from dtrain.plan.partitioners import partition
from dtrain.plan.placement import VariableRequest, place_variables
from dtrain.spec.device import DeviceSpec

PS0, PS1, PS2 = (f"/job:ps/task:{i}/device:CPU:0" for i in range(3))
KB = 1024


def _req(name: str, nbytes: int = 4, pin: str | None = None) -> VariableRequest:
    return VariableRequest(name, (nbytes // 4,), nbytes, DeviceSpec.from_string(pin) if pin is not None else None)


# (id, num_ps, strategy, [(name, bytes, pin)], expected canonical devices)
PLACEMENT_CASES = [
    # --- round robin (_RoundRobinStrategy), TF's docstring example
    ("rr_docstring_v1_v2_v3", 2, "round_robin",
     [("v1", 4, None), ("v2", 4, None), ("v3", 4, None)], [PS0, PS1, PS0]),
    ("rr_one_ps_task", 1, "round_robin",
     [("v1", 4, None), ("v2", 4, None), ("v3", 4, None)], [PS0, PS0, PS0]),
    ("rr_wraps_around", 3, "round_robin",
     [(f"v{i}", 4, None) for i in range(7)], [PS0, PS1, PS2, PS0, PS1, PS2, PS0]),
    ("rr_ignores_sizes", 2, "round_robin",
     [("big", 100 * KB, None), ("small", 4, None), ("small2", 4, None)], [PS0, PS1, PS0]),
    # --- pins inside the ps job: keep the task, still advance the counter
    ("rr_pin_ps_task_advances_counter", 3, "round_robin",
     [("v1", 4, None), ("v2", 4, "/job:ps/task:0"), ("v3", 4, None)], [PS0, PS0, PS2]),
    ("rr_pin_ps_task_first", 3, "round_robin",
     [("v1", 4, "/job:ps/task:2"), ("v2", 4, None), ("v3", 4, None)], [PS2, PS1, PS2]),
    ("rr_pin_ps_job_only_gets_a_task", 3, "round_robin",
     [("v1", 4, None), ("v2", 4, "/job:ps"), ("v3", 4, None)], [PS0, PS1, PS2]),
    ("rr_pin_ps_task_and_device_kept", 2, "round_robin",
     [("v1", 4, "/job:ps/task:1/device:GPU:1"), ("v2", 4, None)], ["/job:ps/task:1/device:GPU:1", PS1]),
    # --- pins outside the ps job: keep the device, do NOT advance the counter
    ("rr_pin_worker_keeps_device", 2, "round_robin",
     [("v1", 4, None), ("v2", 4, "/job:worker/task:1"), ("v3", 4, None)],
     [PS0, "/job:worker/task:1/device:CPU:0", PS1]),
    ("rr_pin_worker_gpu_keeps_device", 2, "round_robin",
     [("v1", 4, "/job:worker/task:0/device:GPU:0"), ("v2", 4, None)], ["/job:worker/task:0/device:GPU:0", PS0]),
    # --- pins without a job: a ps task from the strategy, the pin's other fields kept
    ("rr_pin_device_type_only", 2, "round_robin",
     [("v1", 4, None), ("v2", 4, "/device:GPU:0"), ("v3", 4, None)], [PS0, "/job:ps/task:1/device:GPU:0", PS0]),
    ("rr_pin_short_cpu", 2, "round_robin",
     [("v1", 4, "/cpu:0"), ("v2", 4, "/gpu:*")], [PS0, "/job:ps/task:1/device:GPU:*"]),
    ("rr_pin_replica_kept", 2, "round_robin",
     [("v1", 4, "/job:ps/replica:0"), ("v2", 4, None)], ["/job:ps/replica:0/task:0/device:CPU:0", PS1]),
    # --- greedy by bytes (GreedyLoadBalancingStrategy + byte_size_load_fn)
    ("greedy_big_small_small", 2, "greedy",
     [("big", 100 * KB, None), ("small", 4 * KB, None), ("small2", 4 * KB, None)], [PS0, PS1, PS1]),
    ("greedy_ties_to_lowest_task", 3, "greedy",
     [(f"v{i}", 8, None) for i in range(4)], [PS0, PS1, PS2, PS0]),
    ("greedy_running_loads", 2, "greedy",
     [("a", 40, None), ("b", 4, None), ("c", 4, None), ("d", 4, None), ("e", 32, None), ("f", 20, None)],
     [PS0, PS1, PS1, PS1, PS1, PS0]),  # loads after each: [40,0] [40,4] [40,8] [40,12] [40,44] [60,44]
    ("greedy_outside_ps_not_charged", 2, "greedy",
     [("w", 100 * KB, "/job:worker/task:0"), ("s1", 4, None), ("s2", 8, None), ("s3", 4, None)],
     ["/job:worker/task:0/device:CPU:0", PS0, PS1, PS0]),
    # dtrain's one documented difference: a ps-pinned variable charges the task it lands on (TF would
    # charge argmin = task 0 here, and then send s1 and s2 to task 1).
    ("greedy_ps_pin_charges_its_own_task", 2, "greedy",
     [("big", 100 * KB, "/job:ps/task:1"), ("s1", 4, None), ("s2", 4, None)], [PS1, PS0, PS0]),
    ("greedy_device_type_pin_charged", 2, "greedy",
     [("g", 64, "/device:GPU:0"), ("s1", 4, None)], ["/job:ps/task:0/device:GPU:0", PS1]),
    # --- partitioned places (already split) parts round robin
    ("partitioned_is_round_robin", 3, "partitioned",
     [("b", 4, None), ("w/part_0", 40, None), ("w/part_1", 40, None), ("w/part_2", 40, None)],
     [PS0, PS1, PS2, PS0]),
    # --- no ps tasks: replica_device_setter is a no-op (only the default device type is added)
    ("no_ps_tasks_noop", 0, "round_robin",
     [("v1", 4, None), ("v2", 4, "/job:worker/task:1")], ["/device:CPU:0", "/job:worker/task:1/device:CPU:0"]),
]


@pytest.mark.parametrize(("num_ps", "strategy", "variables", "expected"),
                         [c[1:] for c in PLACEMENT_CASES], ids=[c[0] for c in PLACEMENT_CASES])
def test_place_variables(num_ps, strategy, variables, expected):
    requests = [_req(name, nbytes, pin) for name, nbytes, pin in variables]
    devices = place_variables(requests, "ps", num_ps, strategy)
    assert [d.to_string() for d in devices] == expected
    assert all(isinstance(d, DeviceSpec) for d in devices)


def test_place_variables_other_ps_job_name():
    reqs = [_req("v1"), _req("v2", pin="/job:ps/task:0"), _req("v3", pin="/job:params")]
    devices = place_variables(reqs, "params", 2, "round_robin")
    # A pin to a job named "ps" is outside the ps job "params" here: kept, counter not advanced.
    assert [d.to_string() for d in devices] == [
        "/job:params/task:0/device:CPU:0", "/job:ps/task:0/device:CPU:0", "/job:params/task:1/device:CPU:0"]


def test_place_variables_is_pure_and_repeatable():
    """No state kept between calls (a counter carried over would move the second call's devices)
    and the requests left as they were."""
    import copy

    reqs = [_req(f"v{i}", 4 * (i + 1)) for i in range(5)]
    before = copy.deepcopy(reqs)
    for strategy in ("round_robin", "greedy", "partitioned"):
        first = place_variables(reqs, "ps", 3, strategy)
        place_variables(reqs[:2], "ps", 2, strategy)  # another placement in between
        assert place_variables(reqs, "ps", 3, strategy) == first
    assert reqs == before


def test_place_variables_rejects_unknown_strategy():
    with pytest.raises(ValueError, match=r"unknown placement strategy 'random'.*round_robin, greedy, partitioned"):
        place_variables([_req("v")], "ps", 2, "random")


# ---------------------------------------------------------------------------------------- partition

# (id, shape, num_parts, expected part shapes)
PARTITION_CASES = [
    ("rows_10_over_3", (10, 5), 3, [(4, 5), (3, 5), (3, 5)]),
    ("even_split", (8, 2), 4, [(2, 2)] * 4),
    ("vector", (7,), 2, [(4,), (3,)]),
    ("fewer_rows_than_parts", (2, 3), 3, [(1, 3), (1, 3)]),
    ("one_part", (5, 5), 1, [(5, 5)]),
    ("three_dims", (5, 2, 3), 2, [(3, 2, 3), (2, 2, 3)]),
    ("rows_11_over_4", (11, 1), 4, [(3, 1), (3, 1), (3, 1), (2, 1)]),
]


@pytest.mark.parametrize(("shape", "num_parts", "expected"),
                         [c[1:] for c in PARTITION_CASES], ids=[c[0] for c in PARTITION_CASES])
def test_partition_shapes_names_and_offsets(shape, num_parts, expected):
    parts = partition("w", shape, 4, num_parts)
    assert [p.shape for p in parts] == expected
    assert [p.name for p in parts] == [f"w/part_{i}" for i in range(len(expected))]
    assert all(p.source == "w" and p.pin is None for p in parts)
    row = 1
    for d in shape[1:]:
        row *= d
    # Parts tile the flattened parameter exactly: contiguous starts, bytes = numel * itemsize.
    start = 0
    for p in parts:
        numel = p.shape[0] * row
        assert p.start == start
        assert p.nbytes == numel * 4
        start += numel
    assert start == row * shape[0]


def test_partition_rows_10_over_3_starts():
    parts = partition("0.weight", (10, 64), 4, 3)
    assert [(p.name, p.shape, p.start, p.nbytes) for p in parts] == [
        ("0.weight/part_0", (4, 64), 0, 4 * 64 * 4),
        ("0.weight/part_1", (3, 64), 4 * 64, 3 * 64 * 4),
        ("0.weight/part_2", (3, 64), 7 * 64, 3 * 64 * 4),
    ]


def test_partition_then_place_continues_the_round_robin():
    reqs = [_req("b", 8)] + partition("w", (10, 4), 4, 3) + [_req("c", 8)]
    devices = place_variables(reqs, "ps", 3, "partitioned")
    assert [(r.name, d.to_string()) for r, d in zip(reqs, devices, strict=True)] == [
        ("b", PS0), ("w/part_0", PS1), ("w/part_1", PS2), ("w/part_2", PS0), ("c", PS1)]


@pytest.mark.parametrize(("shape", "num_parts"), [((), 2), ((4,), 0)])
def test_partition_rejects_bad_input(shape, num_parts):
    with pytest.raises(ValueError, match="cannot partition 'w'"):
        partition("w", shape, 4, num_parts)
