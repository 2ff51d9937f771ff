"""The spec models on their own: defaults, building in Python, the hash, the schema, device parsing."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import dtrain
from dtrain.spec.device import DeviceSpec
from dtrain.spec.errors import CrossFieldErrors, Problem, SpecError, dotted
from dtrain.spec.layers import LAYER_NAMES, Layer, LinearLayer, ModelSpec
from dtrain.spec.loading import validate
from dtrain.spec.pipeline import PipelineSpec
from dtrain.spec.sections import AdamOptimizer, ClusterSpec, SgdOptimizer, worker_device_spec
from dtrain.spec.session import CheckpointSpec, HookSpec

MLP: dict[str, Any] = {"input_shape": [4], "layers": [{"type": "linear", "out": 8}, {"type": "relu"},
                                                      {"type": "linear", "out": 3}]}


def mlp(**sections: Any) -> PipelineSpec:
    return PipelineSpec(**{"model": MLP, **sections})


# ------------------------------------------------------------------------------------ defaults


def test_defaults():
    spec = mlp()
    assert spec.name == "dtrain"
    assert spec.cluster.jobs == {"ps": 1, "worker": 2}
    assert spec.cluster.scheduler is None
    assert isinstance(spec.optimizer, SgdOptimizer) and spec.optimizer.name == "sgd" and spec.optimizer.lr == 0.01
    assert spec.training.mode == "async" and spec.training.replication == "between_graph"
    assert spec.training.steps == 1000
    assert spec.placement.variables == "round_robin"
    assert (spec.placement.ps_job, spec.placement.worker_job, spec.placement.worker_device) == ("ps", "worker", "cpu")
    assert spec.data.source == "synthetic" and spec.data.batch_size == 32 and spec.data.standardize
    assert spec.checkpoint is None
    assert spec.summary.every_steps == 100
    assert spec.hooks == [] and spec.graph == [] and spec.variables == [] and spec.fetch == []
    assert spec.model is not None and spec.model.loss == "cross_entropy"
    assert not spec.is_graph


def test_replica_counts_are_derived():
    spec = mlp(training={"mode": "sync"})
    assert spec.num_replicas() == 2
    assert spec.replicas_to_aggregate() == 2
    spec = mlp(cluster={"jobs": {"ps": 2, "worker": 4}}, training={"mode": "sync", "total_num_replicas": 3})
    assert spec.num_replicas() == 3
    assert spec.replicas_to_aggregate() == 3
    spec = mlp(cluster={"jobs": {"ps": 1, "worker": 3}},
               training={"mode": "sync", "replicas_to_aggregate": 2})  # one backup replica
    assert (spec.num_replicas(), spec.replicas_to_aggregate()) == (3, 2)


def test_checkpoint_defaults_to_every_500_steps_unless_timed():
    assert CheckpointSpec().every_steps == 500
    timed = CheckpointSpec(every_secs=30)
    assert timed.every_steps is None and timed.every_secs == 30
    assert mlp(checkpoint={}).checkpoint == CheckpointSpec(every_steps=500, keep=3)


def test_cluster_jobs_as_worker_lists():
    cluster = ClusterSpec(jobs={"ps": ["ps-host:1"], "worker": 3})
    assert cluster.num_tasks("ps") == 1 and cluster.num_tasks("worker") == 3 and cluster.num_tasks("eval") == 0
    assert cluster.task_workers("ps") == ["ps-host:1"]
    assert cluster.task_workers("worker") == ["worker-0", "worker-1", "worker-2"]


def test_layer_params_leave_out_placement_fields():
    layer = LinearLayer(type="linear", out=4, name="head", device="/job:worker")
    assert layer.params() == {"type": "linear", "out": 4, "bias": True}


def test_layer_names_match_the_union():
    union_tags: list[str] = []
    for member in typing.get_args(typing.get_args(Layer)[0]):
        union_tags.extend(typing.get_args(member.model_fields["type"].annotation))
    assert sorted(union_tags) == sorted(LAYER_NAMES)


def test_every_spec_layer_type_is_buildable():
    from dtrain.model.layers import LAYER_TYPES

    assert set(LAYER_NAMES) <= set(LAYER_TYPES)


# ------------------------------------------------------------------------------ built in Python


def test_build_in_code_equals_model_validate_and_load():
    spec = PipelineSpec(
        name="in-code",
        cluster={"jobs": {"ps": 2, "worker": 2}},
        model=ModelSpec(input_shape=[4], layers=[LinearLayer(type="linear", out=3)]),
        optimizer=AdamOptimizer(name="adam", betas=(0.8, 0.9)),
        training={"mode": "sync", "steps": 10},
        hooks=[HookSpec(type="nan_guard")],
    )
    data = {
        "name": "in-code", "cluster": {"jobs": {"ps": 2, "worker": 2}},
        "model": {"input_shape": [4], "layers": [{"type": "linear", "out": 3}]},
        "optimizer": {"name": "adam", "betas": [0.8, 0.9]}, "training": {"mode": "sync", "steps": 10},
        "hooks": [{"type": "nan_guard"}],
    }
    assert PipelineSpec.model_validate(data) == spec
    assert dtrain.loads(
        "name: in-code\ncluster: {jobs: {ps: 2, worker: 2}}\n"
        "model: {input_shape: [4], layers: [{type: linear, out: 3}]}\n"
        "optimizer: {name: adam, betas: [0.8, 0.9]}\ntraining: {mode: sync, steps: 10}\nhooks: [{type: nan_guard}]\n"
    ).pipeline_hash() == spec.pipeline_hash()
    assert isinstance(spec.optimizer, AdamOptimizer) and spec.optimizer.lr == 0.001


def test_a_graph_built_in_code():
    spec = PipelineSpec(cluster={"jobs": {"ps": 1, "worker": 2}},
                        variables=[{"name": "a", "value": 1.0, "device": "/job:ps"}],
                        graph=[{"name": "b", "op": "add", "inputs": ["a", 2], "device": "/job:worker/task:1"}],
                        fetch=["b"])
    assert spec.is_graph and spec.graph[0].inputs == ["a", 2.0]


@pytest.mark.parametrize(
    ("sections", "fragment"),
    [
        ({"training": {"mode": "asynch"}}, "'asynch' is not one of 'async', 'sync'"),
        ({"training": {"steps": True}}, "expected an integer, got True"),
        ({"cluster": {"jobs": {"worker": 2}}}, "job 'ps' is missing"),
        ({"data": {"batch_size": 0}}, "must be >= 1, got 0"),
        ({"hooks": [{"type": "loging"}]}, "did you mean 'logging'"),
    ],
)
def test_bad_specs_in_code_raise_validation_errors(sections: dict[str, Any], fragment: str):
    with pytest.raises(ValidationError):
        mlp(**sections)
    # The same data through the loader's validate(): a SpecError with a readable message.
    with pytest.raises(SpecError) as info:
        validate({"model": MLP, **sections})
    assert fragment in str(info.value)
    assert all(p.file == "<spec>" and p.line == 1 for p in info.value.problems)


def test_graph_and_model_do_not_mix():
    with pytest.raises(ValidationError):
        mlp(fetch=["x"])


def test_a_loaded_spec_pickles_with_its_base_dir(tmp_path):
    import pickle

    path = tmp_path / "p.yaml"
    path.write_text("model: {input_shape: [4], layers: [{type: linear, out: 3}]}\n")
    spec = dtrain.load(path)
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and copy.base_dir == tmp_path.resolve()
    assert mlp().base_dir == Path(".")


# ------------------------------------------------------------------------------ the hash


def test_pipeline_hash_is_stable_and_sensitive():
    a = mlp(training={"steps": 10, "mode": "async"})
    b = PipelineSpec.model_validate({"training": {"mode": "async", "steps": 10}, "model": MLP})
    assert re.fullmatch(r"[0-9a-f]{64}", a.pipeline_hash())
    assert a.pipeline_hash() == b.pipeline_hash() == a.model_copy().pipeline_hash()
    assert mlp(training={"steps": 10}).pipeline_hash() == a.pipeline_hash()  # defaults spelled out or not
    changed = [
        mlp(training={"steps": 11}),
        mlp(training={"steps": 10}, optimizer={"name": "sgd", "lr": 0.02}),
        PipelineSpec(model={**MLP, "layers": [{"type": "linear", "out": 4}]}, training={"steps": 10}),
        mlp(training={"steps": 10}, cluster={"jobs": {"ps": 2, "worker": 2}}),
    ]
    hashes = {s.pipeline_hash() for s in changed}
    assert len(hashes) == len(changed) and a.pipeline_hash() not in hashes


# ------------------------------------------------------------------------------ the schema


def _properties(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return schema.get("properties", {})


def test_schema_describes_every_field_of_every_model():
    schema = PipelineSpec.model_json_schema()
    models = {"PipelineSpec": schema, **schema["$defs"]}
    assert len(models) >= 20
    undocumented = [f"{name}.{field}" for name, model in models.items()
                    for field, prop in _properties(model).items() if not prop.get("description")]
    assert undocumented == []
    for name, model in schema["$defs"].items():
        assert model.get("description") or name.endswith(("Layer", "Optimizer")), name


def test_every_model_class_documents_its_fields():
    seen: set[type[BaseModel]] = set()

    def walk(cls: type[BaseModel]) -> None:
        if cls in seen:
            return
        seen.add(cls)
        for name, info in cls.model_fields.items():
            assert info.description, f"{cls.__name__}.{name}"
            for sub in _models_in(info.annotation):
                walk(sub)

    walk(PipelineSpec)
    assert len(seen) >= 20


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        out.extend(_models_in(arg))
    return out


# ------------------------------------------------------------------------------ devices


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        ("cpu", "/device:CPU:0"),
        ("CPU", "/device:CPU:0"),
        ("cuda", "/device:GPU:0"),
        ("cuda:1", "/device:GPU:1"),
        ("gpu:2", "/device:GPU:2"),
        ("/gpu:0", "/device:GPU:0"),
        ("/cpu:0", "/device:CPU:0"),
        ("/device:GPU:1", "/device:GPU:1"),
    ],
)
def test_worker_device_spec(value: str, canonical: str):
    spec = worker_device_spec(value)
    assert isinstance(spec, DeviceSpec)
    assert spec.to_string() == canonical


@pytest.mark.parametrize("value", ["tpu", "", "cuda:x", "cuda:-1", "/job:worker", "/foo:1", "gpu0", "/tpu:0",
                                   "/device:TPU:0", "/device:MyFunnyDevice:0", "/device:cuda:0",
                                   "/job:worker/device:GPU:1", "/task:1/gpu:0"])
def test_worker_device_spec_rejects(value: str):
    with pytest.raises(ValueError):
        worker_device_spec(value)
    with pytest.raises(ValidationError):
        mlp(placement={"worker_device": value})


def test_device_strings_are_checked_against_the_cluster():
    ok = mlp(placement={"variable_devices": {"0.weight": "/job:ps/task:0"}},
             model={**MLP, "layers": [{"type": "linear", "out": 3, "device": "/job:worker/task:0"}]})
    assert ok.placement.variable_devices == {"0.weight": "/job:ps/task:0"}
    with pytest.raises(SpecError) as info:
        validate({"model": MLP, "placement": {"variable_devices": {"0.weight": "/job:ps/task:1"}}})
    assert info.value.problems[0].path == "placement.variable_devices.0.weight"
    assert "names task 1 but job 'ps' has 1 task(s)" in info.value.problems[0].message
    with pytest.raises(SpecError) as info:
        validate({"model": MLP, "placement": {"worker_device": "/task:1/gpu:0"}})
    assert "worker_device takes only the device part (replica r always runs on worker task r); " \
           "write '/device:GPU:0'" in str(info.value)


# ------------------------------------------------------------------------------ errors


def test_problem_and_dotted_formatting():
    assert dotted(["model", "layers", 2, "out"]) == "model.layers[2].out"
    assert dotted([]) == ""
    assert str(Problem("bad", "training.steps", "p.yaml", 4)) == "p.yaml:4: training.steps: bad"
    assert str(Problem("empty", file="p.yaml", line=1)) == "p.yaml:1: empty"
    err = SpecError([Problem("a", "x", "f", 1), Problem("b", "", "f", 2)])
    assert str(err) == "f:1: x: a\nf:2: b" and isinstance(err, ValueError)
    assert str(CrossFieldErrors([(("training", "mode"), "m"), ((), "n")])) == "training.mode: m; n"


def test_moving_average_is_for_dense_variables_only():
    """Sparse tables are not averaged: a pipeline with one is refused with the fix; a dense
    embedding (sparse: false) is an ordinary variable and is averaged."""
    ctr = Path(__file__).resolve().parents[2] / "pipelines" / "ctr_sparse.yaml"
    with pytest.raises(SpecError) as info:
        dtrain.load(ctr, overrides=["training.moving_average={decay: 0.99}"])
    assert [(p.path, p.message) for p in info.value.problems] == [(
        "training.moving_average", "moving averages are kept for dense variables only, not sparse tables; "
        "remove it, or set sparse: false on the embedding layer (from --set training.moving_average={decay: 0.99})")]
    dense = dtrain.load(ctr, overrides=["training.moving_average={decay: 0.99}", "model.layers.0.sparse=false"])
    assert dense.training.moving_average.decay == 0.99 and dense.training.moving_average.use_for_eval
    assert not dense.has_sparse_tables()


def test_validate_does_not_walk_a_whole_file_system(tmp_path):
    """``data.source: /`` made `dtrain validate` list every file of the machine (minutes, on a file
    that validate is documented safe on): it now looks at a bounded number of entries and leaves a
    larger listing to the run."""
    import subprocess
    import sys
    import time

    f = tmp_path / "p.yaml"
    f.write_text("model:\n  input_shape: [2]\n  layers:\n    - {type: linear, out: 2}\n"
                 "data: {source: /, batch_size: 8}\n")
    root = Path(__file__).resolve().parents[2]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", "validate", str(f)], cwd=root, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - t0 < 20  # (an interpreter's start and dtrain's imports: about 2 s here)


@pytest.mark.parametrize(("key", "value"), [("memory_limit", "1GiB"), ("nthreads", 4), ("dashboard", False),
                                            ("start_method", "spawn")])
def test_a_key_of_the_embedded_cluster_is_refused_on_a_running_cluster(key: str, value: Any):
    """memory_limit, nthreads, dashboard and start_method size the processes the embedded cluster
    starts; a running cluster's workers have their own: refused, naming the key (as cluster.tls
    is), with cluster.scheduler and with the scheduler `dtrain run --scheduler` passes."""
    model = {"input_shape": [4], "layers": [{"type": "linear", "out": 3}]}
    validate({"model": model, "cluster": {key: value}})  # the embedded cluster: fine
    validate({"model": model, "cluster": {"scheduler": "tcp://10.0.0.5:8786"}})  # the defaults: fine
    for cluster, scheduler in (({"scheduler": "tcp://10.0.0.5:8786", key: value}, None),
                               ({key: value}, "tcp://10.0.0.5:8786")):
        with pytest.raises(SpecError) as info:
            validate({"model": model, "cluster": cluster}, scheduler=scheduler)
        problems = info.value.problems
        assert [p.path for p in problems] == [f"cluster.{key}"], problems
        assert f"{key} applies to the embedded cluster" in problems[0].message
        assert f"remove cluster.{key}" in problems[0].message


@pytest.mark.parametrize("where", ["in_graph", "graph"])
def test_observe_is_refused_where_there_is_no_replica_loop(where: str):
    """observe.* measures between_graph replicas; an in_graph run or a graph pipeline has no
    replica loop, so a key set there is refused (an empty observe: {} and the defaults are fine)."""
    if where == "graph":
        base: dict[str, Any] = {"variables": [{"name": "v", "value": 1.0}]}
    else:
        base = {"model": {"input_shape": [4], "layers": [{"type": "linear", "out": 3}]},
                "training": {"replication": "in_graph", "mode": "sync"}}
    validate(base)
    validate({**base, "observe": {}})
    with pytest.raises(SpecError) as info:
        validate({**base, "observe": {"telemetry": False}})
    problems = info.value.problems
    assert [p.path for p in problems] == ["observe.telemetry"], problems
    assert "applies to between_graph replication" in problems[0].message
    if where == "in_graph":  # the same run between graphs measures its replicas: fine
        validate({**base, "training": {"mode": "sync"}, "observe": {"telemetry": False}})
