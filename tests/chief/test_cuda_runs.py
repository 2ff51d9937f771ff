"""Training on a CUDA GPU, end to end: replicas on the GPU in sync mode agree with the same run on
the CPU, a sparse embedding table's rows travel between a GPU replica and the CPU ps, and the
`dtrain` command's own worker processes compute on the GPU. Every test here needs a GPU and is
skipped without one, so a CPU-only CI never runs them. On a GPU machine (``make venv`` installs
torch's CUDA build where ``nvidia-smi`` works): ``.venv/bin/python -m pytest -m cuda`` runs these
and the other ``cuda`` tests; the soft-placement fallback (tests/chief/test_session.py), which
skips where a GPU is visible, runs there with the GPUs hidden:
``CUDA_VISIBLE_DEVICES= .venv/bin/python -m pytest tests/chief/test_session.py -k soft_placement``."""

from __future__ import annotations

import json

import pytest
import torch

import dtrain
from tests.helpers.cli import dtrain_cli
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import PARTITIONED, dlrm_yaml, tiny
from tests.helpers.reference import binary_accuracy as accuracy
from tests.helpers.reference import single_process

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = "placement: {worker_device: cuda, soft: false}\n"


def _final_parameters(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def test_sync_on_cuda_matches_the_cpu_run(inproc_client, tmp_path):
    """Sync between-graph on the GPU applies the same updates as on the CPU: the final parameters
    agree to float32 rounding of different kernels (a replica that skipped moving a gradient off
    the GPU, or pushed a stale one, would be off by a whole learning-rate step)."""
    runs = {}
    for name, extra in {"cpu": "", "cuda": GPU}.items():
        spec = tiny(extra).model_copy(deep=True)
        spec.training.mode, spec.training.steps, spec.training.seed = "sync", 40, 3
        runs[name] = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name)
        assert runs[name].summary["status"] == "completed"
    assert {s["device"] for s in runs["cuda"].replica_stats} == {"cuda:0"}
    assert {s["device"] for s in runs["cpu"].replica_stats} == {"cpu"}
    cpu, gpu = _final_parameters(tmp_path / "cpu"), _final_parameters(tmp_path / "cuda")
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        assert torch.allclose(cpu[k], gpu[k], rtol=1e-3, atol=1e-4), k
    assert runs["cuda"].summary["global_step"] == runs["cpu"].summary["global_step"] == 40


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_table_rows_with_cuda_replicas(inproc_client, tmp_path):
    """The CTR pipeline's 100,000-row table stays on the ps (CPU) while replicas compute on the
    GPU: only the touched rows move, and the model still learns."""
    spec = dtrain.load(PIPELINES / "ctr_sparse.yaml", overrides=[
        "summary.tensorboard=false", "placement.worker_device=cuda", "placement.soft=false"])
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "ctr")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == spec.training.steps
    assert {st["device"] for st in result.replica_stats} == {"cuda:0"}
    final = result.summary["eval"]["accuracy"]
    reference = accuracy(single_process(spec, num_replicas=2), spec)  # the same job on the CPU
    assert abs(final - reference) <= 0.01, (final, reference)


@pytest.mark.processes
def test_cli_run_on_cuda_in_worker_processes(tmp_path):
    """`dtrain run` starts its own worker processes; CUDA initialises in each of them (a fork after
    the parent touched CUDA would fail here) and the digits job reaches its accuracy."""
    # placement.soft: false: a worker process that cannot compute on CUDA fails the run (exit 1)
    out = dtrain_cli("run", str(PIPELINES / "digits_sync.yaml"), "--run-dir", str(tmp_path / "run"),
                     "--set", "placement.worker_device=cuda", "--set", "placement.soft=false", "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["eval"]["accuracy"] >= 0.95


def test_axis_1_partitions_on_cuda_match_the_cpu_run(inproc_client, tmp_path):
    """Variables split along axis 1 (strided parts: each part is a column block of the weight) with
    replicas on the GPU: the strided copies between the flat shard buffers and the GPU model's
    parameters give the CPU run's model (a copy that ignored the stride would scramble columns and
    be off by whole updates)."""
    runs = {}
    for name, extra in {"cpu": [], "cuda": ["placement.worker_device=cuda", "placement.soft=false"]}.items():
        spec = dtrain.loads(PARTITIONED, base_dir=".", overrides=["checkpoint.every_steps=1000", *extra])
        runs[name] = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name)
        assert runs[name].summary["status"] == "completed" and runs[name].summary["global_step"] == 60
    assert {s["device"] for s in runs["cuda"].replica_stats} == {"cuda:0"}
    cpu, gpu = _final_parameters(tmp_path / "cpu"), _final_parameters(tmp_path / "cuda")
    for k in cpu:
        assert torch.allclose(cpu[k], gpu[k], rtol=1e-3, atol=1e-4), k


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_dlrm_on_cuda_replicas_matches_the_cpu_run(inproc_client, tmp_path):
    """The DLRM over packed Criteo-layout records (multi-hot, fixed and vocabulary-free tables on the
    CPU ps): GPU replicas in sync give the CPU replicas' model to float32 rounding of other kernels."""
    import dask.array as da
    import numpy as np

    from dtrain.model.recommendation import record_layout

    text = dlrm_yaml("dlrm-cuda", categorical=[{"name": "C1"}, {"name": "C2", "max_ids": 3, "weighted": True}],
                     tables={"C1": {"num_embeddings": 500, "dim": 4, "init_std": 0.3},
                             "C2": {"dim": 4, "max_rows": 1000, "init_std": 0.3}},
                     data={"batch_size": 32, "shuffle": False}, training={"mode": "sync", "steps": 30, "seed": 3},
                     summary={"tensorboard": False})
    rng = np.random.default_rng(0)
    n = 1600
    lengths = rng.integers(0, 4, n)
    cats = [(rng.integers(0, 10**6, n), np.ones(n, np.int64)), (rng.zipf(1.3, int(lengths.sum())), lengths)]
    y = (cats[0][0] % 3 == 0).astype(np.float32)
    dense = rng.normal(size=(n, 2)).astype(np.float32)
    runs = {}
    for name, extra in {"cpu": "", "cuda": GPU}.items():
        spec = dtrain.loads(text + extra)
        x = record_layout(spec.model.features.model_dump()).pack(
            dense, cats, [None, np.ones(int(lengths.sum()), np.float32)])
        runs[name] = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / name,
                                data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))
        assert runs[name].summary["status"] == "completed"
    assert {s["device"] for s in runs["cuda"].replica_stats} == {"cuda:0"}
    cpu, gpu = _final_parameters(tmp_path / "cpu"), _final_parameters(tmp_path / "cuda")
    assert cpu.keys() == gpu.keys() and torch.equal(cpu["tables.C2.row_ids"], gpu["tables.C2.row_ids"])
    for k in cpu:
        assert torch.allclose(cpu[k].float(), gpu[k].float(), rtol=1e-3, atol=1e-4), k
