"""Tests for dtrain.device, pinning TensorFlow's tf.DeviceSpec behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.spec.device import DeviceSpec, merge_device, parse_device

# (input string, canonical to_string, (job, replica, task, type, index))
PARSE_CASES = [
    (
        "/job:ps/replica:0/task:1/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
        ("ps", 0, 1, "CPU", 0),
    ),
    ("/cpu:0", "/device:CPU:0", (None, None, None, "CPU", 0)),
    ("cpu:0", "/device:CPU:0", (None, None, None, "CPU", 0)),
    ("/CPU:0", "/device:CPU:0", (None, None, None, "CPU", 0)),
    ("/gpu:1", "/device:GPU:1", (None, None, None, "GPU", 1)),
    ("gpu:*", "/device:GPU:*", (None, None, None, "GPU", None)),
    ("/cpu", "/device:CPU:*", (None, None, None, "CPU", None)),
    ("/tpu:3", "/device:TPU:3", (None, None, None, "TPU", 3)),
    ("/device:GPU:*", "/device:GPU:*", (None, None, None, "GPU", None)),
    ("/device:GPU", "/device:GPU:*", (None, None, None, "GPU", None)),
    ("device:cpu:0", "/device:CPU:0", (None, None, None, "CPU", 0)),
    ("/device:Gpu:2", "/device:GPU:2", (None, None, None, "GPU", 2)),
    ("/device:XLA_CPU:0", "/device:XLA_CPU:0", (None, None, None, "XLA_CPU", 0)),
    (
        "/job:muu/task:1/device:MyFunnyDevice:2",
        "/job:muu/task:1/device:MyFunnyDevice:2",
        ("muu", None, 1, "MyFunnyDevice", 2),
    ),
    ("/job:worker/gpu:0", "/job:worker/device:GPU:0", ("worker", None, None, "GPU", 0)),
    ("/task:1/job:ps", "/job:ps/task:1", ("ps", None, 1, None, None)),
    ("/device:CPU:0/task:2/replica:3/job:w", "/job:w/replica:3/task:2/device:CPU:0", ("w", 3, 2, "CPU", 0)),
    ("/replica:1/task:0/cpu:0", "/replica:1/task:0/device:CPU:0", (None, 1, 0, "CPU", 0)),
    ("/job:foo/replica:0", "/job:foo/replica:0", ("foo", 0, None, None, None)),
    ("job:ps/task:0", "/job:ps/task:0", ("ps", None, 0, None, None)),
    ("/job:ps//task:0/", "/job:ps/task:0", ("ps", None, 0, None, None)),
    ("/job:ps/task:0/job:worker", "/job:worker/task:0", ("worker", None, 0, None, None)),
    ("/task:0/task:7", "/task:7", (None, None, 7, None, None)),
    ("/job:my_job_v2", "/job:my_job_v2", ("my_job_v2", None, None, None, None)),
    # C3: '*' leaves job, replica and task unset, as TF's C++ parser reads it.
    ("/job:*/replica:4/gpu:*", "/replica:4/device:GPU:*", (None, 4, None, "GPU", None)),
    ("/gpu:*/job:*/replica:4", "/replica:4/device:GPU:*", (None, 4, None, "GPU", None)),
    ("/job:ps/task:*", "/job:ps", ("ps", None, None, None, None)),
    ("/job:ps/job:*", "", (None, None, None, None, None)),
    ("", "", (None, None, None, None, None)),
    ("/", "", (None, None, None, None, None)),
]


@pytest.mark.parametrize("spec, canonical, fields", PARSE_CASES)
def test_from_string(spec, canonical, fields):
    d = DeviceSpec.from_string(spec)
    assert d.to_string() == canonical
    assert str(d) == canonical
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == fields


@pytest.mark.parametrize("spec, canonical, fields", PARSE_CASES)
def test_canonical_form_round_trips(spec, canonical, fields):
    d = DeviceSpec.from_string(spec)
    assert DeviceSpec.from_string(canonical) == d
    assert DeviceSpec.from_string(d.to_string()).to_string() == canonical


def test_from_string_none_is_empty():
    assert DeviceSpec.from_string(None) == DeviceSpec()
    assert DeviceSpec().to_string() == ""
    assert DeviceSpec().is_empty


BAD_SPECS = [
    ("/job:ps/task:x", "task:x"),
    ("/job:", "job:"),
    ("/task:-1", "task:-1"),
    ("/foo:1", "foo:1"),
    ("/device:GPU:abc", "device:GPU:abc"),
    ("/job:ps/replica:1.5", "replica:1.5"),
    ("job ps", "job ps"),
    ("/job:ps:extra", "job:ps:extra"),
    ("/job:my job", "job:my job"),
    ("/device::0", "device::0"),
    ("/device:GPU:0:1", "device:GPU:0:1"),
    ("/device", "device"),
    ("/gpu:0:1", "gpu:0:1"),
    ("/cpu:-1", "cpu:-1"),
    ("/task:", "task:"),
    ("/replica: 1", "replica: 1"),
    ("/job:muu/device:GPU:2/cpu:0", "cpu:0"),  # TF: multiple device types
    ("/gpu:0/gpu:1", "gpu:1"),
]


@pytest.mark.parametrize("spec, component", BAD_SPECS)
def test_malformed_raises(spec, component):
    with pytest.raises(ValueError) as info:
        DeviceSpec.from_string(spec)
    msg = str(info.value)
    assert repr(spec) in msg
    assert repr(component) in msg
    assert "/job:<name>/replica:<int>/task:<int>/device:<TYPE>:<int|*>" in msg


def test_multiple_devices_message():
    with pytest.raises(ValueError, match="multiple device types are not allowed"):
        DeviceSpec.from_string("/job:muu/device:GPU:2/cpu:0")


def test_from_string_rejects_non_str():
    with pytest.raises(TypeError):
        DeviceSpec.from_string(3)  # type: ignore[arg-type]


# (outer, inner, merged)
MERGE_CASES = [
    ("/job:ps", "/task:1/device:GPU:0", "/job:ps/task:1/device:GPU:0"),
    ("/job:ps/task:0", "/job:worker", "/job:worker/task:0"),
    ("/job:worker/task:1", "/cpu:0", "/job:worker/task:1/device:CPU:0"),
    ("/job:worker/task:1/device:GPU:0", "", "/job:worker/task:1/device:GPU:0"),
    ("", "/job:worker/task:1/device:GPU:0", "/job:worker/task:1/device:GPU:0"),
    ("", "", ""),
    # TF's device_spec_test merge chain.
    (
        "/job:foo/replica:0/task:0/device:GPU:0",
        "/job:boo/device:GPU:0",
        "/job:boo/replica:0/task:0/device:GPU:0",
    ),
    ("/job:boo/replica:0/task:0/device:GPU:0", "/job:muu/cpu:2", "/job:muu/replica:0/task:0/device:CPU:2"),
    (
        "/job:muu/replica:0/task:0/device:CPU:2",
        "/job:muu/device:MyFunnyDevice:2",
        "/job:muu/replica:0/task:0/device:MyFunnyDevice:2",
    ),
    # Plain field-wise override: an unset inner index keeps the outer index.
    ("/device:GPU:1", "/device:CPU:*", "/device:CPU:1"),
    ("/job:ps/device:GPU:*", "/gpu:3", "/job:ps/device:GPU:3"),
    ("/replica:2/task:5", "/replica:0", "/replica:0/task:5"),
]


@pytest.mark.parametrize("outer, inner, merged", MERGE_CASES)
def test_make_merged_spec(outer, inner, merged):
    o, i = DeviceSpec.from_string(outer), DeviceSpec.from_string(inner)
    assert o.make_merged_spec(i).to_string() == merged
    # Inputs are untouched (immutable).
    assert o.to_string() == DeviceSpec.from_string(outer).to_string()
    assert i.to_string() == DeviceSpec.from_string(inner).to_string()


@pytest.mark.parametrize("outer, inner, merged", MERGE_CASES)
def test_merge_device_accepts_strings_and_specs(outer, inner, merged):
    assert merge_device(outer, inner).to_string() == merged
    assert merge_device(DeviceSpec.from_string(outer), inner).to_string() == merged
    assert merge_device(outer, DeviceSpec.from_string(inner)).to_string() == merged
    assert merge_device(outer or None, inner).to_string() == merged


def test_merge_with_empty_is_identity_both_ways():
    d = DeviceSpec("ps", 1, 2, "GPU", 3)
    assert d.make_merged_spec(DeviceSpec()) == d
    assert DeviceSpec().make_merged_spec(d) == d


def test_make_merged_spec_rejects_string():
    with pytest.raises(TypeError):
        DeviceSpec().make_merged_spec("/job:ps")  # type: ignore[arg-type]


# (constructor kwargs, to_string)
CTOR_CASES = [
    (dict(), ""),
    (dict(job="ps"), "/job:ps"),
    (dict(job="ps", task=0), "/job:ps/task:0"),
    (dict(device_type="cpu", device_index=0), "/device:CPU:0"),
    (dict(device_type="gpu"), "/device:GPU:*"),
    (dict(device_type="Gpu", device_index=1), "/device:GPU:1"),
    (dict(device_type="TPU", device_index=0), "/device:TPU:0"),
    (
        dict(job="w", replica=0, task=3, device_type="GPU", device_index=1),
        "/job:w/replica:0/task:3/device:GPU:1",
    ),
    (dict(task="2"), "/task:2"),  # TF coerces with int()
    (dict(device_index=4), ""),  # index without type is not printed (as TF)
]


@pytest.mark.parametrize("kwargs, expected", CTOR_CASES)
def test_constructor_to_string(kwargs, expected):
    assert DeviceSpec(**kwargs).to_string() == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(job=""),
        dict(job="a/b"),
        dict(job="a:b"),
        dict(job="a b"),
        dict(job=3),
        dict(task=-1),
        dict(replica=1.5),
        dict(task=True),
        dict(task="x"),
        dict(device_index=-2),
        dict(device_type=""),
        dict(device_type="GPU:0"),
    ],
)
def test_constructor_rejects_invalid(kwargs):
    with pytest.raises(ValueError):
        DeviceSpec(**kwargs)


def test_eq_and_hash():
    a = DeviceSpec.from_string("/task:1/job:ps/gpu:0")
    b = DeviceSpec(job="ps", task=1, device_type="GPU", device_index=0)
    c = DeviceSpec.from_string("/job:ps/task:1/device:GPU:1")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert {a: "x"}[b] == "x"
    assert a != "/job:ps/task:1/device:GPU:0"  # no comparison with strings
    assert DeviceSpec() == DeviceSpec.from_string("")


def test_immutable():
    d = DeviceSpec.from_string("/job:ps/task:0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.job = "worker"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.task = 1  # type: ignore[misc]


def test_replace():
    d = DeviceSpec.from_string("/job:ps/task:0/device:GPU:1")
    assert d.replace(task=3).to_string() == "/job:ps/task:3/device:GPU:1"
    assert d.replace(device_type="cpu", device_index=None).to_string() == ("/job:ps/task:0/device:CPU:*")
    assert d.replace(job=None).to_string() == "/task:0/device:GPU:1"
    assert d.to_string() == "/job:ps/task:0/device:GPU:1"
    with pytest.raises(ValueError):
        d.replace(task=-5)
    with pytest.raises(TypeError):
        d.replace(bogus=1)


@pytest.mark.parametrize(
    "spec, is_cpu, is_gpu",
    [
        ("/cpu:0", True, False),
        ("/device:cpu:*", True, False),
        ("/gpu:0", False, True),
        ("/job:w/device:GPU:*", False, True),
        ("/tpu:0", False, False),
        ("/job:ps", False, False),
    ],
)
def test_is_cpu_is_gpu(spec, is_cpu, is_gpu):
    d = DeviceSpec.from_string(spec)
    assert d.is_cpu is is_cpu
    assert d.is_gpu is is_gpu


@pytest.mark.parametrize(
    "spec, key",
    [
        ("/job:ps/task:0", "/job:ps/task:0"),
        ("/job:ps/replica:2/task:1/device:CPU:0", "/job:ps/task:1"),
        ("/device:GPU:0/task:3/job:worker", "/job:worker/task:3"),
    ],
)
def test_task_key(spec, key):
    assert DeviceSpec.from_string(spec).task_key() == key


@pytest.mark.parametrize("spec", ["", "/job:ps", "/task:0", "/job:ps/cpu:0"])
def test_task_key_requires_job_and_task(spec):
    with pytest.raises(ValueError, match="job and task"):
        DeviceSpec.from_string(spec).task_key()


def test_parse_device():
    d = DeviceSpec(job="ps", task=0)
    assert parse_device(d) is d
    assert parse_device("/task:0/job:ps") == d
    assert parse_device(None) == DeviceSpec()
    assert parse_device("") == DeviceSpec()
    with pytest.raises(TypeError):
        parse_device(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_device("/job:ps/task:x")


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "/job:ps",
        "/job:ps/replica:0/task:1/device:GPU:*",
        "/device:CPU:0",
    ],
)
def test_repr_is_evaluable(spec):
    d = DeviceSpec.from_string(spec)
    r = repr(d)
    assert r.startswith("DeviceSpec(")
    assert eval(r, {"DeviceSpec": DeviceSpec}) == d


# ---------------------------------------------------------------- C++ parser rows (tf-semantics C1-C3)


def test_c1_full_name_parses():
    d = DeviceSpec.from_string("/job:foo/replica:1/task:2/gpu:3")
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == ("foo", 1, 2, "GPU", 3)


@pytest.mark.parametrize("spec, component", [
    ("/job:123/replica:1/task:2/gpu:3", "job:123"),
    ("/job:foo/replica:-1/task:2/gpu:3", "replica:-1"),
    ("/job:foo/replica:1/task:2/bar:3", "bar:3"),
    ("/job:foo/replica:1/task:2/gpu:3/extra", "extra"),
    ("foobar", "foobar"),
])
def test_c2_invalid_names(spec, component):
    with pytest.raises(ValueError) as info:
        DeviceSpec.from_string(spec)
    assert repr(component) in str(info.value)


@pytest.mark.parametrize("job", ["123", "1ps", "my-job", "ps.v2", "_ps", "wörker"])
def test_c2_job_names_follow_the_cpp_rule(job):
    with pytest.raises(ValueError, match=r"must match \[a-zA-Z\]\[_a-zA-Z0-9\]\*"):
        DeviceSpec.from_string(f"/job:{job}/task:0")
    with pytest.raises(ValueError, match=r"must match \[a-zA-Z\]\[_a-zA-Z0-9\]\*"):
        DeviceSpec(job=job)


@pytest.mark.parametrize("job", ["ps", "worker", "local", "moon", "chief", "w", "Worker2", "param_server"])
def test_c2_usual_job_names_stay_valid(job):
    assert DeviceSpec.from_string(f"/job:{job}").job == job


def test_c3_star_means_unset():
    a = DeviceSpec.from_string("/job:*/replica:4/gpu:*")
    b = DeviceSpec.from_string("/gpu:*/job:*/replica:4")
    assert a == b == DeviceSpec(replica=4, device_type="GPU")
    assert a.job is None and a.task is None and a.device_index is None
    # merging an unset job keeps the outer one (it is not a job named '*')
    assert merge_device("/job:ps/task:1", "/job:*/cpu:0").to_string() == "/job:ps/task:1/device:CPU:0"


# ---------------------------------------------------------------- nested scopes (tf-semantics N4-N10, N13)


def test_n4_to_n7_chain_with_merge_device():
    scope = merge_device("/device:GPU:0", "/job:worker")
    assert scope.to_string() == "/job:worker/device:GPU:0"  # N4
    scope = merge_device(scope, "/device:CPU:0")
    assert scope.to_string() == "/job:worker/device:CPU:0"  # N5
    scope = merge_device(scope, "/job:ps")
    assert scope.to_string() == "/job:ps/device:CPU:0"  # N6
    assert merge_device(scope, "").to_string() == "/job:ps/device:CPU:0"  # N7: "" inherits


def test_n8_n9_unset_index_keeps_the_outer_one():
    assert merge_device("/device:GPU:7", "/device:GPU:*").to_string() == "/device:GPU:7"
    assert merge_device("", "/device:CPU:*").to_string() == "/device:CPU:*"
    assert merge_device("/device:CPU:*", "/device:CPU:5").to_string() == "/device:CPU:5"


@pytest.mark.parametrize("clear", [None, "none", "None", " NONE "])
def test_n10_none_clears_every_outer_scope(clear):
    outer = "/job:worker/replica:2/device:CPU:1"
    cleared = merge_device(outer, clear)
    assert cleared == DeviceSpec() and cleared.to_string() == ""  # no device at all
    # ... and a scope inside the cleared one starts from nothing
    assert merge_device(cleared, "/job:ps").to_string() == "/job:ps"
    # the empty string is not a clear: it inherits (N7)
    assert merge_device(outer, "").to_string() == outer


def test_none_is_not_a_device_string():
    with pytest.raises(ValueError, match="'none'"):
        DeviceSpec.from_string("none")
