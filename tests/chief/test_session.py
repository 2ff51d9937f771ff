"""The session on a real (in-process) Dask cluster: async runs end to end through the Python API,
the run directory contract, failures that end the run instead of hanging it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.errors import RunDirError, RunError
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import pipeline_yaml, tiny


def pipeline(name: str) -> Path:
    return PIPELINES / name

SUMMARY_KEYS = {"name", "status", "global_step", "final_loss", "eval", "wall_s", "samples_per_sec", "mode",
                "replication", "replicas", "recoveries", "dropped_stale"}


def test_digits_async_python_api_reaches_accuracy(inproc_client, run_dir):
    spec = dtrain.load(pipeline("digits_async.yaml"))
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    s = result.summary
    assert s["status"] == "completed"
    assert s["eval"]["accuracy"] >= 0.95
    assert SUMMARY_KEYS <= s.keys()
    assert s["global_step"] >= spec.training.steps
    assert s["dropped_stale"] == 0 and s["recoveries"] == 0
    assert s["mode"] == "async" and s["replication"] == "between_graph" and s["replicas"] == 2
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["eval"] == s["eval"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x and "eval" not in x]
    assert [x["step"] for x in train][:3] == [100, 200, 300]
    assert all({"step", "time", "loss", "samples_per_sec", "dropped_stale"} <= x.keys() for x in train)
    assert any("eval" in x for x in lines)
    # model.pt loads with weights_only=True into build_model(spec) and reproduces the accuracy.
    state = torch.load(run_dir / "model.pt", weights_only=True)
    model = dtrain.build_model(spec)
    model.load_state_dict(state)
    data = dtrain.worker.replica.dataset_for(spec)
    ev = dtrain.worker.replica.evaluate(model, torch.as_tensor(data.x_test), torch.as_tensor(data.y_test), "cross_entropy")
    assert ev["accuracy"] == pytest.approx(s["eval"]["accuracy"])
    assert (run_dir / "tb").is_dir()


def test_overlap_trains_and_counts_steps(inproc_client, run_dir):
    spec = tiny("", ).model_copy(deep=True)
    spec.training.overlap = True
    spec.training.steps = 80
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed"
    assert spec.training.steps <= result.summary["global_step"] <= spec.training.steps + 4
    assert result.summary["final_loss"] < 2.3  # below chance-level cross-entropy (ln 10)


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adagrad"])
def test_optimizers_train(inproc_client, run_dir, optimizer):
    spec = tiny("\n").model_copy(deep=True)
    spec = dtrain.PipelineSpec.model_validate({**spec.model_dump(exclude={"optimizer"}),
                                              "optimizer": {"name": optimizer, "lr": 0.01}})
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert result.summary["status"] == "completed"
    assert result.summary["final_loss"] < first["loss"]


def test_replica_error_ends_run_with_its_message(inproc_client, run_dir):
    spec = dtrain.loads(pipeline_yaml("broken", jobs={"ps": 1, "worker": 2},
                                      model={"module": "tests.helpers.models:BrokenMLP"}, optimizer=None, steps=50,
                                      summary=None))
    with pytest.raises(RunError, match=r"replica \d .*mat1 and mat2 shapes cannot be multiplied"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "mat1 and mat2" in summary["error"]


def test_run_dir_with_checkpoints_needs_resume(inproc_client, run_dir):
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "ckpt-00000010.pt").write_bytes(b"x")
    with pytest.raises(RunDirError, match="--resume"):
        dtrain.run(tiny(), client=inproc_client, run_dir=run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # nothing else written


def test_missing_task_is_named(inproc_client, run_dir):
    spec = tiny().model_copy(deep=True)
    spec.cluster.jobs = {"ps": 4, "worker": 2}  # the shared cluster has ps-0..2 only
    spec.cluster.wait_s = 1.0
    with pytest.raises(RunError, match=r"/job:ps/task:3"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)


def test_soft_placement_falls_back_to_cpu(inproc_client, run_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: soft placement has nothing to fall back from")
    spec = tiny("placement: {worker_device: cuda, soft: true}\n")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed"
    assert {s["device"] for s in result.replica_stats} == {"cpu"}


def test_hard_gpu_placement_without_gpu_fails_clearly(inproc_client, run_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    spec = tiny("placement: {worker_device: /gpu:0, soft: false}\n")
    with pytest.raises(RunError, match="placement.soft"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)


@pytest.mark.cuda
def test_replicas_compute_on_cuda(inproc_client, run_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = tiny("placement: {worker_device: cuda, soft: false}\n")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed"
    assert {s["device"] for s in result.replica_stats} == {"cuda:0"}
    assert result.summary["final_loss"] < 2.3


def test_dask_actor_data_plane_async(inproc_client, run_dir):
    """training.transport: dask keeps the flat buffers on ps actor calls (async here; sync is
    compared bit for bit with the socket data plane below)."""
    spec = tiny().model_copy(deep=True)
    spec.training.transport = "dask"
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed" and result.summary["global_step"] >= 60
    assert result.summary["final_loss"] < 2.3
    assert result.summary["data_plane"]["connections"] == 0  # no socket was opened


def test_every_data_plane_trains_identically(inproc_client, tmp_path):
    """Sync between-graph is deterministic: the same pipeline through the shared-memory slots,
    through the socket's bytes pushed whole, through the socket's bytes pushed in buckets during
    backward, and through Dask actor calls (transport: dask) ends on the same parameters; the
    summary says which data plane was used."""
    variants = {"shm": (True, 0.0), "tcp": (False, 0.0), "tcp-buckets": (False, 0.0005)}
    results = {}
    for name, (shm, bucket_mb) in variants.items():
        spec = tiny("").model_copy(deep=True)
        spec.training.mode = "sync"
        spec.training.shared_memory = shm
        spec.training.bucket_mb = bucket_mb
        results[name] = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name)
    dask = tiny("").model_copy(deep=True)
    dask.training.mode = "sync"
    dask.training.transport = "dask"
    via_actors = dtrain.run(dask, client=inproc_client, run_dir=tmp_path / "dask")
    assert via_actors.summary["global_step"] == 60 and via_actors.summary["data_plane"]["connections"] == 0
    for key, value in via_actors.model.state_dict().items():
        assert torch.equal(value, results["shm"].model.state_dict()[key]), ("dask", key)
    for name, result in results.items():
        dp = result.summary["data_plane"]
        assert dp["transport"] == "socket" and dp["connections"] == 4  # 2 replicas x 2 shards
        shared = name == "shm" and os.path.isdir("/dev/shm")
        assert dp["shared_memory_connections"] == (4 if shared else 0)
        # sync without backup replicas: the shm replicas read the ps's parameters in place (no
        # snapshot), and still end bit for bit where the socket's and Dask's replicas do
        assert dp["in_place_connections"] == (4 if shared else 0)
        parts = [st["extra"].get("parts_sent", 0) for st in result.replica_stats]
        # 0.0005 MB = 131 floats: the 32x10 and 64x32 weights are buckets of their own
        assert all(p >= 60 for p in parts) if name == "tcp-buckets" else parts == [0, 0]
        assert result.summary["global_step"] == 60
    reference = results["shm"].model.state_dict()
    for name in ("tcp", "tcp-buckets"):
        for key, value in results[name].model.state_dict().items():
            assert torch.equal(value, reference[key]), (name, key)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_cpus_spreads_the_replicas_of_one_machine(inproc_client, run_dir):
    spec = tiny("").model_copy(deep=True)
    spec.training.pin_cpus = True
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert result.summary["status"] == "completed"
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {st["replica"]: st["extra"]["cpus"] for st in result.replica_stats}
    # both workers are on 127.0.0.1: local ranks 0 and 1, each on its own CPU (wrapping around)
    assert cpus == {0: [allowed[0]], 1: [allowed[1 % len(allowed)]]}


def test_bfloat16_on_the_wire_end_to_end(inproc_client, tmp_path):
    """wire_dtype: bfloat16 through the shared-memory slots and over the socket's bytes: the same
    rounding both ways (identical parameters), a different result from float32 (the bytes really
    were narrowed), and still training."""
    results = {}
    for name, (wire, shm) in {"f32": ("float32", True), "bf16-shm": ("bfloat16", True),
                              "bf16-tcp": ("bfloat16", False)}.items():
        spec = tiny("").model_copy(deep=True)
        spec.training.mode = "sync"
        spec.training.steps = 100
        spec.training.wire_dtype = wire
        spec.training.shared_memory = shm
        results[name] = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name)
        assert results[name].summary["data_plane"]["wire_dtype"] == wire
    a, b, f = (results[k].model.state_dict() for k in ("bf16-shm", "bf16-tcp", "f32"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], f[k]) for k in a)
    assert results["bf16-tcp"].summary["eval"]["accuracy"] >= 0.85


def test_checkpoints_every_secs(inproc_client, run_dir):
    """checkpoint.every_secs alone: a checkpoint whenever that much time has passed, at whatever
    step it is (the shards held at one step for each)."""
    spec = dtrain.loads(pipeline_yaml(
        "every-secs", model={"module": "tests.helpers.slowmodels:SlowMLP", "kwargs": {"delay_s": 0.01, "fast_delay_s": 0.01}},
        optimizer=None, mode="sync", steps=150, checkpoint={"every_secs": 0.4, "keep": 100}), base_dir=".")
    assert spec.checkpoint.every_steps is None
    s = dtrain.run(spec, client=inproc_client, run_dir=run_dir).summary
    steps = [int(name[5:13]) for name in s["checkpoints"]]
    assert len(steps) >= 3 and steps == sorted(set(steps)) and steps[-1] == 150, steps
    times = [ckpt.verify(path)["time"] for path in ckpt.list_checkpoints(run_dir)[:-1]]
    assert all(b - a >= 0.35 for a, b in zip(times, times[1:], strict=False)), times  # paced by time


def test_a_diverged_run_never_completes_and_its_summary_is_strict_json(inproc_client, run_dir):
    """lr 1e30 and no nan_guard hook: the parameters blow up; the run fails (no model.pt, no
    non-finite checkpoint) and summary.json holds no bare NaN."""
    spec = tiny("checkpoint: {every_steps: 20}\n").model_copy(deep=True)
    spec.optimizer.lr = 1e30
    with pytest.raises(RunError, match="non-finite"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    text = (run_dir / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in summary.json"))
    assert summary["status"] == "failed" and "non-finite" in summary["error"]
    assert not (run_dir / "model.pt").exists()
    for path in ckpt.list_checkpoints(run_dir):
        assert all(torch.isfinite(sh["params"]).all() for sh in ckpt.verify(path)["shards"])
