"""Tests for dtrain.compiler: spec -> Plan, pure, with the `dtrain plan --json` contract (docs/cli.md)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import yaml

import dtrain
from dtrain.plan.compiler import Plan, resolve_workers
from dtrain.plan.layout import ShardLayout
from dtrain.spec.errors import SpecError
from tests.helpers.paths import PIPELINES

CANONICAL = re.compile(r"^/job:[^/:]+(/replica:\d+)?/task:\d+/device:[A-Za-z_]\w*:(\d+|\*)$")


def _raw(name: str) -> dict:
    return yaml.safe_load((PIPELINES / f"{name}.yaml").read_text())


def _spec(name: str, **sections) -> dtrain.PipelineSpec:
    """A golden pipeline with some sections overridden (merged one level deep)."""
    data = copy.deepcopy(_raw(name))
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return dtrain.PipelineSpec.model_validate(data, context={"base_dir": str(PIPELINES)})


@pytest.fixture(scope="module")
def digits() -> dtrain.PipelineSpec:
    return dtrain.load(PIPELINES / "digits_async.yaml")


@pytest.fixture(scope="module")
def digits_plan(digits) -> Plan:
    return dtrain.compile(digits)


def assert_consistent(plan: Plan) -> None:
    """Invariants every training plan keeps: what the runtime's ShardLayout relies on."""
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    for s in plan.shards:
        held = sorted((v for v in plan.variables if v.shard == s.index), key=lambda v: v.offset)
        offset = 0
        for v in held:  # contiguous, in creation order, no gaps, no overlaps
            assert v.offset == offset, (s.task, v.name)
            offset += v.numel
        assert s.numel == offset and s.bytes == 4 * offset
        assert all(v.device.startswith(s.task + "/") for v in held)
        assert [v.name for v in held] == [v.name for v in plan.variables if v.shard == s.index]
    for v in plan.variables:
        assert CANONICAL.match(v.device), v.device
        numel = 1
        for d in v.shape:
            numel *= d
        assert v.numel == numel and v.bytes == 4 * numel
    ps_bytes: dict[str, int] = {}
    for s in plan.shards:  # a task may hold several shards (one per pipeline stage)
        if s.task in plan.ps_bytes:
            ps_bytes[s.task] = ps_bytes.get(s.task, 0) + s.bytes + s.table_bytes
    assert plan.ps_bytes == ps_bytes
    for s in plan.shards:  # a sparse table's rows count on the task holding them, nowhere else
        assert s.table_bytes == sum(p.bytes for t in plan.tables for p in t.parts if p.shard == s.index)
    assert [s.holds_global_step for s in plan.shards] == [s.index == 0 for s in plan.shards]
    for r in plan.replicas:
        assert r.device.startswith(r.task + "/") and CANONICAL.match(r.device)


def _torch_params(spec) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in dtrain.build_model(spec).named_parameters()]


# ------------------------------------------------------------------------------------- variables


def test_digits_variables_as_torch_names_them(digits, digits_plan):
    assert [(v.name, v.shape) for v in digits_plan.variables] == _torch_params(digits)
    assert [v.name for v in digits_plan.variables] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [v.shape for v in digits_plan.variables] == [(128, 64), (128,), (10, 128), (10,)]
    assert [v.bytes for v in digits_plan.variables] == [128 * 64 * 4, 128 * 4, 10 * 128 * 4, 10 * 4]
    assert [v.device for v in digits_plan.variables] == [
        "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0",
        "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"]
    assert all(v.source == v.name and v.start == 0 for v in digits_plan.variables)
    assert_consistent(digits_plan)


def test_digits_ps_bytes_count_parameters_only(digits, digits_plan):
    model_bytes = sum(p.numel() * 4 for p in dtrain.build_model(digits).parameters())
    assert sum(digits_plan.ps_bytes.values()) == model_bytes
    assert digits_plan.ps_bytes == {"/job:ps/task:0": (8192 + 1280) * 4, "/job:ps/task:1": (128 + 10) * 4}


def test_digits_shards_and_replicas(digits_plan):
    assert [(s.task, s.worker, s.address, s.numel, s.holds_global_step) for s in digits_plan.shards] == [
        ("/job:ps/task:0", "ps-0", None, 9472, True), ("/job:ps/task:1", "ps-1", None, 138, False)]
    assert [(v.shard, v.offset) for v in digits_plan.variables] == [(0, 0), (1, 0), (0, 8192), (1, 128)]
    assert [(r.index, r.task, r.worker, r.device) for r in digits_plan.replicas] == [
        (0, "/job:worker/task:0", "worker-0", "/job:worker/task:0/device:CPU:0"),
        (1, "/job:worker/task:1", "worker-1", "/job:worker/task:1/device:CPU:0")]
    assert digits_plan.num_replicas == 2


@pytest.mark.parametrize(("worker_device", "device"), [
    ("cpu", "CPU:0"), ("cuda", "GPU:0"), ("cuda:1", "GPU:1"), ("/gpu:0", "GPU:0"), ("GPU", "GPU:0"),
    ("/device:GPU:1", "GPU:1"),  # a job or task is refused by the spec: replica r always runs on worker task r
])
def test_worker_device(worker_device, device):
    plan = dtrain.compile(_spec("digits_async", placement={"worker_device": worker_device}))
    assert [r.device for r in plan.replicas] == [f"/job:worker/task:{i}/device:{device}" for i in range(2)]
    assert all(v.device.endswith("/device:CPU:0") for v in plan.variables)  # ps stays on CPU
    assert_consistent(plan)


def test_total_num_replicas_and_sync(digits):
    plan = dtrain.compile(_spec("digits_sync", cluster={"jobs": {"ps": 1, "worker": 3}},
                                training={"total_num_replicas": 3, "replicas_to_aggregate": 2}))
    assert (plan.mode, plan.num_replicas, plan.replicas_to_aggregate) == ("sync", 3, 2)
    assert [r.task for r in plan.replicas] == [f"/job:worker/task:{i}" for i in range(3)]
    plan = dtrain.compile(_spec("digits_async", training={"total_num_replicas": 1}))
    assert [r.task for r in plan.replicas] == ["/job:worker/task:0"]


# ------------------------------------------------------------------------------------------ pins


def _devices(plan: Plan) -> dict[str, str]:
    return {v.name: v.device for v in plan.variables}


def test_pin_exact_name_keeps_task_and_advances_round_robin():
    plan = dtrain.compile(_spec("digits_async", cluster={"jobs": {"ps": 3, "worker": 2}},
                                placement={"variable_devices": {"0.bias": "/job:ps/task:0"}}))
    # 0.weight -> 0; 0.bias pinned to 0 (consumes task 1's turn); 2.weight -> 2; 2.bias -> 0.
    assert _devices(plan) == {"0.weight": "/job:ps/task:0/device:CPU:0", "0.bias": "/job:ps/task:0/device:CPU:0",
                              "2.weight": "/job:ps/task:2/device:CPU:0", "2.bias": "/job:ps/task:0/device:CPU:0"}
    assert plan.ps_bytes == {"/job:ps/task:0": (8192 + 128 + 10) * 4, "/job:ps/task:1": 0,
                             "/job:ps/task:2": 1280 * 4}
    assert plan.shards[1].numel == 0  # an empty ps task is still a shard (TF: an idle ps task)
    assert_consistent(plan)


def test_pin_prefix_and_longest_prefix_wins():
    plan = dtrain.compile(_spec("synthetic_mlp", cluster={"jobs": {"ps": 2, "worker": 2}}, placement={
        "variable_devices": {"2.": "/job:ps/task:1", "4.": "/job:ps/task:1", "4.bias": "/job:ps/task:0"}}))
    assert _devices(plan) == {
        "0.weight": "/job:ps/task:0/device:CPU:0", "0.bias": "/job:ps/task:1/device:CPU:0",
        "2.weight": "/job:ps/task:1/device:CPU:0", "2.bias": "/job:ps/task:1/device:CPU:0",
        "4.weight": "/job:ps/task:1/device:CPU:0", "4.bias": "/job:ps/task:0/device:CPU:0"}
    assert_consistent(plan)


def test_nested_prefix_longest_wins():
    from dtrain.plan.compiler import _pin_for

    pins = {"enc.": "/job:ps/task:0", "enc.layer.": "/job:ps/task:1", "enc.layer.0.bias": "/job:worker/task:0"}
    assert str(_pin_for("enc.layer.0.weight", pins)) == "/job:ps/task:1"
    assert str(_pin_for("enc.proj.weight", pins)) == "/job:ps/task:0"
    assert str(_pin_for("enc.layer.0.bias", pins)) == "/job:worker/task:0"
    assert _pin_for("dec.weight", pins) is None


def test_pin_outside_ps_job_gets_its_own_shard():
    plan = dtrain.compile(_spec("digits_async", placement={"variable_devices": {"0.bias": "/job:worker/task:1"}}))
    # 0.bias keeps its device and does not advance round robin: 2.weight takes task 1's turn.
    assert _devices(plan) == {"0.weight": "/job:ps/task:0/device:CPU:0", "0.bias": "/job:worker/task:1/device:CPU:0",
                              "2.weight": "/job:ps/task:1/device:CPU:0", "2.bias": "/job:ps/task:0/device:CPU:0"}
    assert [(s.task, s.worker, s.numel, s.holds_global_step) for s in plan.shards] == [
        ("/job:ps/task:0", "ps-0", 8192 + 10, True), ("/job:ps/task:1", "ps-1", 1280, False),
        ("/job:worker/task:1", "worker-1", 128, False)]
    assert plan.ps_bytes == {"/job:ps/task:0": (8192 + 10) * 4, "/job:ps/task:1": 1280 * 4}
    assert_consistent(plan)


def test_pin_device_type_only_gets_a_ps_task():
    """replica_device_setter's merge: a pin with only a device type still gets a ps task (and
    advances round robin). The placement rule is TF's; the spec refuses a GPU type on variables
    (the ps holds them in CPU memory: tests/specs/invalid/variable_device_gpu.yaml)."""
    from dtrain.plan.placement import VariableRequest, place_variables
    from dtrain.spec.device import DeviceSpec

    reqs = [VariableRequest("w", (4,), 16, DeviceSpec.from_string("/device:GPU:0")), VariableRequest("b", (4,), 16)]
    assert [d.to_string() for d in place_variables(reqs, "ps", 2, "round_robin")] == [
        "/job:ps/task:0/device:GPU:0", "/job:ps/task:1/device:CPU:0"]
    plan = dtrain.compile(_spec("digits_async", placement={"variable_devices": {"0.weight": "/device:CPU:0"}}))
    assert _devices(plan)["0.weight"] == "/job:ps/task:0/device:CPU:0"
    assert _devices(plan)["0.bias"] == "/job:ps/task:1/device:CPU:0"
    assert_consistent(plan)


@pytest.mark.parametrize(("key", "hint"), [("0.wieght", "names no parameter"), ("0", "write '0.'"),
                                           ("7.", "names no parameter")])
def test_pin_matching_no_parameter_is_an_error(key, hint):
    spec = _spec("digits_async", placement={"variable_devices": {key: "/job:ps/task:1"}})
    with pytest.raises(SpecError, match=re.escape(hint)) as err:
        dtrain.compile(spec)
    assert f"placement.variable_devices.{key}: '{key}' names no parameter" in str(err.value)
    assert "0.weight, 0.bias, 2.weight, 2.bias" in str(err.value)


# ------------------------------------------------------------------------------------ strategies


def test_greedy_on_digits():
    plan = dtrain.compile(_spec("digits_async", placement={"variables": "greedy"}))
    # loads: 0.weight 32768 -> 0; 0.bias 512 -> 1; 2.weight 5120 -> 1; 2.bias 40 -> 1.
    assert [v.device.split("/device")[0] for v in plan.variables] == [
        "/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:1", "/job:ps/task:1"]
    assert plan.ps_bytes == {"/job:ps/task:0": 32768, "/job:ps/task:1": 512 + 5120 + 40}
    assert_consistent(plan)


def test_partitioned_synthetic_mlp_over_two_ps():
    spec = _spec("synthetic_mlp", cluster={"jobs": {"ps": 2, "worker": 2}}, placement={"variables": "partitioned"})
    plan = dtrain.compile(spec)
    ps = "/job:ps/task:{}/device:CPU:0"
    # 0.weight (1.6 MB) and 2.weight (1 MB) exceed min_slice_bytes (256 KiB) and are split by rows;
    # every variable and part takes the next ps task in creation order.
    assert [(v.name, v.shape, v.device, v.source, v.start) for v in plan.variables] == [
        ("0.weight/part_0", (256, 784), ps.format(0), "0.weight", 0),
        ("0.weight/part_1", (256, 784), ps.format(1), "0.weight", 256 * 784),
        ("0.bias", (512,), ps.format(0), "0.bias", 0),
        ("2.weight/part_0", (256, 512), ps.format(1), "2.weight", 0),
        ("2.weight/part_1", (256, 512), ps.format(0), "2.weight", 256 * 512),
        ("2.bias", (512,), ps.format(1), "2.bias", 0),
        ("4.weight", (10, 512), ps.format(0), "4.weight", 0),
        ("4.bias", (10,), ps.format(1), "4.bias", 0),
    ]
    total = sum(n * 4 for _, shape, n in _layout(spec))
    assert sum(plan.ps_bytes.values()) == total == 669706 * 4
    assert_consistent(plan)
    # The runtime's layout round-trips a real model's parameters through the shard buffers.
    model = dtrain.build_model(spec)
    params = dict(model.named_parameters())
    layout = ShardLayout.from_plan(plan)
    buffers = layout.pack(params)
    assert [b.numel() for b in buffers] == [s.numel for s in plan.shards]
    back = layout.unpack(buffers, {n: p.shape for n, p in params.items()})
    assert all(torch.equal(back[n], p.detach()) for n, p in params.items())


def _layout(spec):
    from dtrain.plan.compiler import parameter_layout

    return parameter_layout(spec)


def test_partitioned_odd_rows_and_threshold():
    spec = _spec("digits_async", cluster={"jobs": {"ps": 3, "worker": 2}},
                 placement={"variables": "partitioned", "min_slice_bytes": 512})
    plan = dtrain.compile(spec)
    # 0.weight (128 rows) -> 43, 43, 42; 0.bias (512 B, at the threshold) -> 43, 43, 42;
    # 2.weight (10 rows) -> 4, 3, 3; 2.bias (40 B) stays whole.
    assert [(v.name, v.shape[0], v.start) for v in plan.variables] == [
        ("0.weight/part_0", 43, 0), ("0.weight/part_1", 43, 43 * 64), ("0.weight/part_2", 42, 86 * 64),
        ("0.bias/part_0", 43, 0), ("0.bias/part_1", 43, 43), ("0.bias/part_2", 42, 86),
        ("2.weight/part_0", 4, 0), ("2.weight/part_1", 3, 4 * 128), ("2.weight/part_2", 3, 7 * 128),
        ("2.bias", 10, 0)]
    assert [v.device[:14] for v in plan.variables] == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:2"] * 3 \
        + ["/job:ps/task:0"]
    assert sum(plan.ps_bytes.values()) == sum(p.numel() * 4 for p in dtrain.build_model(spec).parameters())
    assert_consistent(plan)


def test_partitioned_with_one_ps_or_a_pin_does_not_split():
    plan = dtrain.compile(_spec("synthetic_mlp", placement={"variables": "partitioned"}))
    assert [v.name for v in plan.variables] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    plan = dtrain.compile(_spec("synthetic_mlp", cluster={"jobs": {"ps": 2, "worker": 2}}, placement={
        "variables": "partitioned", "variable_devices": {"0.weight": "/job:ps/task:1"}}))
    assert plan.variables[0].name == "0.weight" and plan.variables[0].device == "/job:ps/task:1/device:CPU:0"
    assert plan.variables[1].name == "0.bias" and plan.variables[1].device == "/job:ps/task:1/device:CPU:0"
    assert plan.variables[2].name == "2.weight/part_0"
    assert_consistent(plan)


# --------------------------------------------------------------------------------------- workers


def _info(name, *resources: str) -> dict:
    return {"name": name, "resources": {r: 1.0 for r in resources}}


def test_workers_by_name(digits):
    workers = {f"tcp://127.0.0.1:{4000 + i}": _info(n) for i, n in enumerate(["worker-1", "ps-0", "worker-0", "ps-1"])}
    plan = dtrain.compile(digits, workers)
    assert [(s.worker, s.address) for s in plan.shards] == [("ps-0", "tcp://127.0.0.1:4001"),
                                                            ("ps-1", "tcp://127.0.0.1:4003")]
    assert [(r.worker, r.address) for r in plan.replicas] == [("worker-0", "tcp://127.0.0.1:4002"),
                                                              ("worker-1", "tcp://127.0.0.1:4000")]
    assert plan.missing_tasks == ()
    assert "on tcp://127.0.0.1:4001" in plan.format()


def test_workers_as_a_list_of_infos(digits):
    infos = [{"address": f"tcp://h:{i}", **_info(n)} for i, n in enumerate(["ps-0", "ps-1", "worker-0", "worker-1"])]
    addresses, missing = resolve_workers(digits, infos)
    assert addresses == {"/job:ps/task:0": "tcp://h:0", "/job:ps/task:1": "tcp://h:1",
                         "/job:worker/task:0": "tcp://h:2", "/job:worker/task:1": "tcp://h:3"}
    assert missing == []


def test_workers_by_listed_address():
    spec = _spec("digits_async", cluster={"jobs": {"ps": ["tcp://10.0.0.1:2222", "10.0.0.2:2222"],
                                                   "worker": ["node7", "trainer-b"]}})
    workers = {"tcp://10.0.0.2:2222": _info(11), "tcp://10.0.0.1:2222": _info(10),
               "tcp://node7:39001": _info("x"), "tls://10.0.0.9:1": _info("trainer-b")}
    addresses, missing = resolve_workers(spec, workers)
    assert addresses == {"/job:ps/task:0": "tcp://10.0.0.1:2222",  # the full address
                         "/job:ps/task:1": "tcp://10.0.0.2:2222",  # host:port, as TF's ClusterSpec lists it
                         "/job:worker/task:0": "tcp://node7:39001",  # a bare host
                         "/job:worker/task:1": "tls://10.0.0.9:1"}  # a listed worker name
    assert missing == []
    plan = dtrain.compile(spec, workers)
    assert [s.worker for s in plan.shards] == ["tcp://10.0.0.1:2222", "10.0.0.2:2222"]
    assert [r.worker for r in plan.replicas] == ["node7", "trainer-b"]


def test_exact_match_is_never_taken_by_an_earlier_host_match():
    spec = _spec("digits_async", cluster={"jobs": {"ps": ["node1"], "worker": ["tcp://node1:9000", "worker-1"]}},
                 placement={"worker_device": "cpu"})
    workers = {"tcp://node1:9000": _info("a"), "tcp://node1:8000": _info("b"), "tcp://node2:1": _info("worker-1")}
    addresses, missing = resolve_workers(spec, workers)
    assert addresses["/job:ps/task:0"] == "tcp://node1:8000"
    assert addresses["/job:worker/task:0"] == "tcp://node1:9000"
    assert missing == []


def test_workers_by_resource(digits):
    # Unnamed workers (Dask's default integer names) tagged with the job's resource.
    workers = {"tcp://127.0.0.1:5003": _info(3, "worker"), "tcp://127.0.0.1:5000": _info(0, "ps"),
               "tcp://127.0.0.1:5001": {"name": 1, "resources": {"ps": 1.0}},
               "tcp://127.0.0.1:5002": _info("worker-0", "worker")}
    addresses, missing = resolve_workers(digits, workers)
    assert addresses == {"/job:ps/task:0": "tcp://127.0.0.1:5000", "/job:ps/task:1": "tcp://127.0.0.1:5001",
                         "/job:worker/task:0": "tcp://127.0.0.1:5002",  # by name, before any resource match
                         "/job:worker/task:1": "tcp://127.0.0.1:5003"}
    assert missing == []


def test_missing_tasks(digits):
    workers = {"tcp://a:1": _info("ps-0"), "tcp://a:2": _info("worker-0"), "tcp://a:3": _info("spare")}
    addresses, missing = resolve_workers(digits, workers)
    assert missing == ["/job:ps/task:1", "/job:worker/task:1"]
    plan = dtrain.compile(digits, workers)
    assert plan.missing_tasks == ("/job:ps/task:1", "/job:worker/task:1")
    assert [s.address for s in plan.shards] == ["tcp://a:1", None]
    assert "missing tasks: /job:ps/task:1, /job:worker/task:1" in plan.format()
    # A worker task that runs no replica is not needed.
    plan = dtrain.compile(_spec("digits_async", training={"total_num_replicas": 1}), workers)
    assert plan.missing_tasks == ("/job:ps/task:1",)


def test_no_workers_resolves_nothing(digits):
    addresses, missing = resolve_workers(digits, None)
    assert set(addresses) == {"/job:ps/task:0", "/job:ps/task:1", "/job:worker/task:0", "/job:worker/task:1"}
    assert set(addresses.values()) == {None} and missing == []


# ----------------------------------------------------------------------------------- json/format


def test_to_json_contract(digits, digits_plan):
    doc = digits_plan.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert [{k: v[k] for k in ("name", "shape", "bytes", "device")} for v in doc["variables"]] == [
        {"name": n, "shape": list(s), "bytes": 4 * int(torch.Size(s).numel()),
         "device": f"/job:ps/task:{i % 2}/device:CPU:0"} for i, (n, s) in enumerate(_torch_params(digits))]
    assert [{k: r[k] for k in ("task", "device")} for r in doc["replicas"]] == [
        {"task": "/job:worker/task:0", "device": "/job:worker/task:0/device:CPU:0"},
        {"task": "/job:worker/task:1", "device": "/job:worker/task:1/device:CPU:0"}]
    assert doc["ps_bytes"] == {"/job:ps/task:0": 37888, "/job:ps/task:1": 552}


def test_to_json_snapshot(digits, digits_plan):
    doc = digits_plan.to_json()
    assert doc.pop("pipeline_hash") == digits.pipeline_hash()
    assert re.fullmatch(r"[0-9a-f]{64}", digits.pipeline_hash())
    ps0, ps1 = "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"
    assert doc == {
        "name": "digits-async", "mode": "async", "replication": "between_graph", "steps": 1500,
        "replicas_to_aggregate": 2, "num_replicas": 2,
        "variables": [
            {"name": "0.weight", "shape": [128, 64], "bytes": 32768, "device": ps0, "shard": 0, "offset": 0,
             "numel": 8192, "source": "0.weight", "start": 0},
            {"name": "0.bias", "shape": [128], "bytes": 512, "device": ps1, "shard": 1, "offset": 0,
             "numel": 128, "source": "0.bias", "start": 0},
            {"name": "2.weight", "shape": [10, 128], "bytes": 5120, "device": ps0, "shard": 0, "offset": 8192,
             "numel": 1280, "source": "2.weight", "start": 0},
            {"name": "2.bias", "shape": [10], "bytes": 40, "device": ps1, "shard": 1, "offset": 128,
             "numel": 10, "source": "2.bias", "start": 0},
        ],
        "shards": [
            {"index": 0, "task": "/job:ps/task:0", "worker": "ps-0", "address": None, "numel": 9472,
             "bytes": 37888, "holds_global_step": True, "table_bytes": 0, "stage": 0},
            {"index": 1, "task": "/job:ps/task:1", "worker": "ps-1", "address": None, "numel": 138,
             "bytes": 552, "holds_global_step": False, "table_bytes": 0, "stage": 0},
        ],
        "replicas": [
            {"index": 0, "task": "/job:worker/task:0", "worker": "worker-0", "address": None,
             "device": "/job:worker/task:0/device:CPU:0", "stage_tasks": []},
            {"index": 1, "task": "/job:worker/task:1", "worker": "worker-1", "address": None,
             "device": "/job:worker/task:1/device:CPU:0", "stage_tasks": []},
        ],
        "layers": [
            {"index": 0, "type": "linear", "name": "linear_0", "device": "/job:worker/device:CPU:0",
             "output_shape": [128]},
            {"index": 1, "type": "relu", "name": "relu_1", "device": "/job:worker/device:CPU:0",
             "output_shape": [128]},
            {"index": 2, "type": "linear", "name": "linear_2", "device": "/job:worker/device:CPU:0",
             "output_shape": [10]},
        ],
        "ops": [], "fetch": [], "ps_bytes": {"/job:ps/task:0": 37888, "/job:ps/task:1": 552},
        "missing_tasks": [], "tables": [], "data": None, "epochs": None,
        "stages": [], "stage_positions": 1, "microbatches": 1, "assignment": "", "shared_tasks": [],
        "replicas_min": None, "aggregate_fraction": None, "sync_tokens": False, "adaptive": None,
    }


def test_format_mentions_every_variable_and_replica(digits_plan):
    text = digits_plan.format()
    assert text.splitlines()[0] == "plan digits-async: async between_graph, 2 replica(s), 1500 steps"
    for v in digits_plan.variables:
        assert re.search(rf"^  {re.escape(v.name)} .* -> {re.escape(v.device)}  \[shard {v.shard} @ {v.offset}\]$",
                         text, re.M), v.name
    for r in digits_plan.replicas:
        assert f"replica {r.index}  -> {r.device}  on {r.worker}" in text
    for task, nbytes in digits_plan.ps_bytes.items():
        assert re.search(rf"^  {re.escape(task)} +{nbytes} B", text, re.M)


def test_layer_devices():
    spec = _spec("digits_async", model={"input_shape": [64], "loss": "cross_entropy", "layers": [
        {"type": "linear", "out": 32}, {"type": "relu", "name": "act", "device": "/job:worker/task:1"},
        {"type": "linear", "out": 10, "device": "/job:worker/task:1/gpu:0"}]}, placement={"worker_device": "cpu"})
    plan = dtrain.compile(spec)
    assert [(layer.name, layer.device, layer.output_shape) for layer in plan.layers] == [
        ("linear_0", "/job:worker/task:0/device:CPU:0", (32,)), ("act", "/job:worker/task:1/device:CPU:0", (32,)),
        ("linear_2", "/job:worker/task:1/device:GPU:0", (10,))]
    # Three stages (one per device) on two stage tasks; one pipeline replica on the 2 worker tasks.
    assert [(s.position, s.device, s.layers) for s in plan.stages] == [
        (0, "/job:worker/task:0/device:CPU:0", ("linear_0",)), (1, "/job:worker/task:1/device:CPU:0", ("act",)),
        (1, "/job:worker/task:1/device:GPU:0", ("linear_2",))]
    assert plan.num_replicas == 1 and plan.replicas[0].stage_tasks == ("/job:worker/task:0", "/job:worker/task:1")


# ----------------------------------------------------------------------------------------- graphs


def test_pinning_graph_ops():
    plan = dtrain.compile(dtrain.load(PIPELINES / "pinning_graph.yaml"))
    assert [(o.name, o.op, o.inputs, o.device, o.worker) for o in plan.ops] == [
        ("a", "variable", (), "/job:ps/task:0/device:CPU:0", "ps-0"),
        ("b", "add", ("a", 2.0), "/job:worker/task:0/device:CPU:0", "worker-0"),
        ("c", "add", ("a", "b"), "/job:worker/task:1/device:CPU:0", "worker-1")]
    assert plan.ops[0].value == 1.0
    assert plan.fetch == ("c",) and plan.variables == () and plan.replicas == ()
    text = plan.format()
    assert text.splitlines()[0] == "plan pinning-graph: graph, 3 node(s), fetch c"
    assert "c = add(a, b)  -> /job:worker/task:1/device:CPU:0  on worker-1" in text
    workers = {"tcp://x:1": _info("ps-0"), "tcp://x:2": _info("worker-0")}
    plan = dtrain.compile(dtrain.load(PIPELINES / "pinning_graph.yaml"), workers)
    assert plan.missing_tasks == ("/job:worker/task:1",)
    assert [o.address for o in plan.ops] == ["tcp://x:1", "tcp://x:2", None]
    json.dumps(plan.to_json())


def test_hello_graph_ops():
    plan = dtrain.compile(dtrain.load(PIPELINES / "hello_graph.yaml"))
    assert [(o.name, o.device, o.worker) for o in plan.ops] == [
        ("hello", "/job:local/task:0/device:CPU:0", "local-0"),
        ("answer", "/job:local/task:0/device:CPU:0", "local-0")]
    assert plan.fetch == ("answer",)


def test_graph_variables_round_robin_over_ps():
    spec = dtrain.loads("""
cluster: {jobs: {ps: 2, worker: 1}}
variables:
  - {name: x, value: 1.0}
  - {name: y, value: [1.0, 2.0], device: /job:worker}
  - {name: z, value: 3.0}
  - {name: w, value: 4.0, device: /gpu:0}
graph:
  - {name: s, op: add, inputs: [x, z]}
  - {name: t, op: mul, inputs: [s, w], device: /job:ps/task:1}
fetch: [t]
""")
    plan = dtrain.compile(spec)
    assert [(o.name, o.device) for o in plan.ops] == [
        ("x", "/job:ps/task:0/device:CPU:0"), ("y", "/job:worker/task:0/device:CPU:0"),
        ("z", "/job:ps/task:1/device:CPU:0"), ("w", "/job:ps/task:0/device:GPU:0"),
        ("s", "/job:worker/task:0/device:CPU:0"), ("t", "/job:ps/task:1/device:CPU:0")]
    assert plan.ops[1].value == [1.0, 2.0]


def test_nested_scopes_graph_places_relative_pins_like_tf():
    """SEED-16: replica_device_setter(ps_tasks=2) > tf.device("/task:1") > tf.device("/cpu:0")."""
    plan = dtrain.compile(dtrain.load(PIPELINES / "nested_scopes_graph.yaml"))
    assert [(o.name, o.device, o.worker) for o in plan.ops] == [
        ("v1", "/job:ps/task:0/device:CPU:0", "ps-0"), ("v2", "/job:ps/task:1/device:CPU:0", "ps-1"),
        ("v3", "/job:ps/task:0/device:CPU:0", "ps-0"), ("s", "/job:worker/task:0/device:CPU:0", "worker-0"),
        ("p1", "/job:worker/task:1/device:CPU:0", "worker-1"), ("p2", "/job:worker/task:1/device:CPU:0", "worker-1")]
    assert plan.to_json()["ops"][4]["device"] == "/job:worker/task:1/device:CPU:0"


def test_graph_relative_pins_and_clearing():
    spec = dtrain.loads("""
cluster: {jobs: {ps: 2, worker: 3}}
variables:
  - {name: a, value: 1.0, device: /task:1}        # a ps task: /job:ps/task:1, still advances round robin
  - {name: b, value: 2.0}                         # round robin: task 1
  - {name: c, value: 3.0, device: none}           # tf.device(None): no ps slot, the session's task
  - {name: d, value: 4.0}                         # round robin: task 0 (c took no slot)
  - {name: e, value: 5.0, device: /job:*/gpu:0}   # job:* is unset: the setter places it
graph:
  - {name: f, op: add, inputs: [a, b], device: /task:2/gpu:1}
  - {name: g, op: neg, inputs: [f], device: none}
  - {name: h, op: neg, inputs: [f], device: /job:ps}
fetch: [g]
""")
    assert [(o.name, o.device) for o in dtrain.compile(spec).ops] == [
        ("a", "/job:ps/task:1/device:CPU:0"), ("b", "/job:ps/task:1/device:CPU:0"),
        ("c", "/job:worker/task:0/device:CPU:0"), ("d", "/job:ps/task:0/device:CPU:0"),
        ("e", "/job:ps/task:1/device:GPU:0"), ("f", "/job:worker/task:2/device:GPU:1"),
        ("g", "/job:worker/task:0/device:CPU:0"), ("h", "/job:ps/task:0/device:CPU:0")]


@pytest.mark.parametrize("jobs, worker", [("{worker: 2}", "worker"), ("{local: 2}", "local")])
def test_graph_without_ps_job_keeps_variables_on_the_default_op_device(jobs, worker):
    """R10: replica_device_setter with ps_tasks=0 places nothing: variables stay where the ops run."""
    spec = dtrain.loads(f"""
cluster: {{jobs: {jobs}}}
variables:
  - {{name: x, value: 1.0}}
  - {{name: y, value: 2.0}}
  - {{name: z, value: 3.0, device: /task:1}}
graph:
  - {{name: s, op: add, inputs: [x, y]}}
fetch: [s]
""")
    assert [(o.name, o.device) for o in dtrain.compile(spec).ops] == [
        ("x", f"/job:{worker}/task:0/device:CPU:0"), ("y", f"/job:{worker}/task:0/device:CPU:0"),
        ("z", f"/job:{worker}/task:1/device:CPU:0"), ("s", f"/job:{worker}/task:0/device:CPU:0")]


def test_graph_initializer_seed_is_resolved_in_the_plan():
    text = """
training: {seed: %d}
cluster: {jobs: {ps: 1, worker: 1}}
variables:
  - {name: w, shape: [2, 2], initializer: {type: random_normal, mean: 1.0, stddev: 0.5, seed: 7}}
  - {name: u, shape: [3], initializer: {type: random_uniform, maxval: 4.0}}
  - {name: v, shape: [3], initializer: {type: random_uniform, maxval: 4.0}}
"""
    w, u, v = dtrain.compile(dtrain.loads(text % 0)).ops
    assert w.value == {"shape": [2, 2], "initializer": {"type": "random_normal", "mean": 1.0, "stddev": 0.5,
                                                        "minval": 0.0, "maxval": 1.0, "seed": 7}}
    assert u.value["shape"] == [3] and u.value["initializer"]["maxval"] == 4.0
    seed_u, seed_v = u.value["initializer"]["seed"], v.value["initializer"]["seed"]
    assert seed_u != seed_v  # derived from the name...
    assert dtrain.compile(dtrain.loads(text % 0)).ops[1].value["initializer"]["seed"] == seed_u  # ...repeatably
    assert "  w = variable(random_normal 2x2, seed 7)  -> /job:ps/task:0/device:CPU:0" in \
        dtrain.compile(dtrain.loads(text % 0)).format()
    other = dtrain.compile(dtrain.loads(text % 1)).ops
    assert other[1].value["initializer"]["seed"] != seed_u and other[0].value == w.value  # training.seed counts


def test_relative_pins_of_layers_and_variables_resolve_like_full_ones(digits):
    relative = _spec("digits_async", placement={"variable_devices": {"2.": "/task:1"}})
    full = _spec("digits_async", placement={"variable_devices": {"2.": "/job:ps/task:1"}})
    assert [v.device for v in dtrain.compile(relative).variables] == [v.device for v in dtrain.compile(full).variables]
    plans = [dtrain.compile(_spec("digits_async", placement={"worker_device": "cpu"}, model={
        "input_shape": [64], "loss": "cross_entropy",
        "layers": [{"type": "linear", "out": 16}, {"type": "relu", "device": pin},
                   {"type": "linear", "out": 10, "device": pin}]}))
        for pin in ("/task:1", "/job:worker/task:1")]
    assert [s.device for s in plans[0].stages] == [s.device for s in plans[1].stages] == [
        "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]


# ----------------------------------------------------------------------------------------- purity


def test_compile_is_pure_and_deterministic(digits, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = torch.random.get_rng_state()
    before = digits.model_dump()
    workers = {"tcp://b:2": _info("ps-1"), "tcp://a:1": _info("ps-0")}
    first, second = dtrain.compile(digits, workers), dtrain.compile(digits, dict(reversed(workers.items())))
    assert first == second
    assert first.to_json() == second.to_json() and first.format() == second.format()
    assert dtrain.compile(digits) == dtrain.compile(dtrain.load(PIPELINES / "digits_async.yaml"))
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert torch.equal(rng, torch.random.get_rng_state())  # no global RNG consumed
    assert digits.model_dump() == before  # the spec is untouched
    with pytest.raises(AttributeError):
        first.name = "other"  # frozen


@pytest.mark.parametrize("name", sorted(p.stem for p in PIPELINES.glob("*.yaml")))
def test_every_golden_pipeline_compiles(name):
    plan = dtrain.compile(dtrain.load(PIPELINES / f"{name}.yaml"))
    json.dumps(plan.to_json())
    if plan.variables:
        assert_consistent(plan)
        assert list(plan.ps_bytes) == [f"/job:ps/task:{i}" for i in range(len(plan.ps_bytes))]
    assert plan.format()


@pytest.mark.parametrize("name", sorted(p.stem for p in PIPELINES.glob("*.yaml")))
def test_a_plan_compiled_once_then_put_on_workers_is_the_plan_compiled_with_them(name):
    """A run compiles once and puts that plan on the workers there are, again whenever they change
    (on_workers): the same plan as compiling with the workers, named or assigned automatically,
    all of them or one missing, an earlier automatic assignment kept."""
    from dtrain.plan.compiler import on_workers

    spec = dtrain.load(PIPELINES / f"{name}.yaml")
    tasks = [f"{j}-{i}" for j in spec.cluster.jobs for i in range(spec.cluster.num_tasks(j))]
    named = {f"tcp://10.0.0.{n}:1": {"name": t} for n, t in enumerate(tasks)}
    anon = {f"tcp://10.0.1.{n}:1": {"name": str(n)} for n in range(len(tasks) + 1)}
    compiled = dtrain.compile(spec)
    placed = dtrain.compile(spec, anon)
    kept = {t.task: t.address for t in (*placed.shards, *placed.replicas) if t.address}  # the earlier assignment
    for workers, keep in [(None, None), (named, None), (dict(list(named.items())[:-1]), None), (anon, None),
                          (dict(list(anon.items())[::-1][1:]), kept)]:
        assert on_workers(compiled, spec, workers, keep).to_json() == \
            dtrain.compile(spec, workers, keep=keep).to_json()


def test_a_sharded_datasets_assignment_joins_a_compiled_plan():
    from dtrain.chief.inputs import file_input
    from dtrain.plan.compiler import with_data

    spec = dtrain.load(PIPELINES / "stream_parquet.yaml")
    data = file_input(spec, with_stats=False)
    assert with_data(dtrain.compile(spec), data) == dtrain.compile(spec, data=data)
