"""The Python API examples (examples/*.py), each run as a user runs it: ``python examples/X.py``
from the repository root, in a subprocess, with a small step count, checking what it printed and
what it wrote to its run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # each example is a Python process of its own

TIMEOUT_S = 240


def run_example(name: str, *args: str, **env: str | int | float) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "RUN_DIR", "THRESHOLD", "PIPELINE")}
    full_env.update({k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, f"examples/{name}.py", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"no match for {pattern!r} in:\n{text}"
    return float(m.group(1))


@pytest.mark.processes
def test_spec_in_code_runs_on_its_own_cluster_of_worker_processes(tmp_path):
    run_dir = tmp_path / "run"
    out = run_example("spec_in_code", "150", RUN_DIR=run_dir).stdout
    assert "workers: ['ps-0', 'worker-0', 'worker-1']" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 150
    assert (summary["mode"], summary["replicas"], summary["ps_tasks"]) == ("async", 2, ["/job:ps/task:0"])
    accuracy = number(r"eval accuracy: ([0-9.]+)", out)
    assert accuracy == pytest.approx(summary["eval"]["accuracy"], abs=1e-4)
    assert accuracy > 0.8  # 10 classes: chance is 0.1; 150 async steps reach about 0.9
    # The example's cluster: its own scheduler on 127.0.0.1 and one worker process per task.
    cluster = json.loads((run_dir / "cluster.json").read_text())
    assert cluster["scheduler"].startswith("tcp://127.0.0.1:")
    assert sorted(cluster["tasks"]) == ["/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"]
    assert len({t["pid"] for t in cluster["tasks"].values()}) == 3
    assert all(t["address"].startswith("tcp://127.0.0.1:") for t in cluster["tasks"].values())


def test_custom_module_and_hook_stop_the_run_early(tmp_path):
    run_dir = tmp_path / "run"
    out = run_example("custom_module_and_hook", RUN_DIR=run_dir, STEPS=3000, THRESHOLD=0.3).stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    # The custom module was trained: model.pt holds Net's parameters, not a layers MLP's.
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(state) == {"inp.weight", "inp.bias", "block.0.weight", "block.0.bias", "out.weight", "out.bias"}
    assert state["inp.weight"].shape == (48, 64)  # model.kwargs reached Net(hidden=48)
    # The hook stopped it at the first loss below the threshold, long before training.steps.
    record = json.loads((run_dir / "stop_below_loss.json").read_text())
    stopped = record["stopped_at"]
    assert stopped is not None and record["threshold"] == 0.3
    assert stopped <= summary["global_step"] == record["final_step"] < 3000
    losses_until_stop = [loss for step, loss in record["seen"] if step <= stopped]
    assert losses_until_stop[-1] < 0.3 and all(loss >= 0.3 for loss in losses_until_stop[:-1])
    assert [s for s, _ in record["seen"]] == sorted(s for s, _ in record["seen"])
    assert f"stopped at global step {summary['global_step']} of 3000" in out
    assert number(r"eval accuracy: ([0-9.]+)", out) > 0.85  # a training loss below 0.3 on digits
    # In-process workers: every task ran in the example's own process.
    cluster = json.loads((run_dir / "cluster.json").read_text())
    assert len({t["pid"] for t in cluster["tasks"].values()}) == 1


def test_custom_hook_lets_the_run_finish_when_the_loss_stays_above_its_threshold(tmp_path):
    run_dir = tmp_path / "run"
    run_example("custom_module_and_hook", "60", RUN_DIR=run_dir, THRESHOLD=0.0)
    summary = json.loads((run_dir / "summary.json").read_text())
    record = json.loads((run_dir / "stop_below_loss.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 60
    assert record["stopped_at"] is None and record["final_step"] == 60
    assert record["seen"] and all(loss > 0 for _, loss in record["seen"])


@pytest.mark.processes
def test_load_model_for_inference_trains_once_then_reuses_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    first = run_example("load_model_for_inference", str(run_dir), STEPS=300).stdout
    assert f"training digits-async for 300 steps into {run_dir}" in first
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 300
    few = number(r"accuracy on 16 test samples: ([0-9.]+)", first)
    assert few >= 0.5  # 16 samples, 10 classes: chance is 0.1
    # The model loaded from model.pt, on the test split rebuilt here, scores what the run's own
    # evaluation scored (a wrong split, preprocessing or load would not).
    whole = number(r"accuracy on all 360 test samples: ([0-9.]+)", first)
    assert whole == pytest.approx(summary["eval"]["accuracy"], abs=1e-4)
    assert whole > 0.8
    predicted = re.search(r"predicted: (\[.*\])", first).group(1)
    true = re.search(r"true: +(\[.*\])", first).group(1)
    agree = sum(p == t for p, t in zip(json.loads(predicted), json.loads(true), strict=True))
    assert agree / 16 == pytest.approx(few)
    # Again on the same directory: no training, the same model, the same predictions.
    second = run_example("load_model_for_inference", str(run_dir), STEPS=300).stdout
    assert second.splitlines()[0] == f"reusing {run_dir / 'model.pt'}"
    assert second.splitlines()[1:] == first.splitlines()[1:]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sparse_recommender_trains_its_tables_on_the_ps_and_serves_from_model_pt(tmp_path):
    run_dir = tmp_path / "run"
    out = run_example("sparse_recommender", "60", RUN_DIR=run_dir).stdout
    assert "table users.weight: embedding 100000x16 (50000 rows on /job:ps/task:0, 50000 rows on " \
           "/job:ps/task:1)" in out
    assert "table items.weight: embedding_bag 100000x16" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 60
    accuracy = number(r"eval accuracy: ([0-9.]+)", out)
    assert accuracy == pytest.approx(summary["eval"]["accuracy"], abs=1e-4)
    assert accuracy > 0.6  # majority 0.50; one epoch reaches about 0.67
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert state["users.weight"].shape == state["items.weight"].shape == (100_000, 16)
    probabilities = [float(p) for p in out.split("first 5 examples: ")[1].split()]
    assert len(probabilities) == 5 and all(0 < p < 1 for p in probabilities) and len(set(probabilities)) > 1


def test_make_parquet_shards_writes_the_pipelines_data_again_byte_for_byte(tmp_path):
    """The seeded generator: the committed pipelines/data/stream/ is exactly what it writes."""
    proc = run_example("make_parquet_shards", "--out", str(tmp_path / "s"), "--rows", "12000", "--files", "4",
                       "--features", "16", "--classes", "4", "--row-group", "1000")
    assert "wrote 12000 rows in 4 files" in proc.stdout
    committed = sorted((ROOT / "pipelines" / "data" / "stream").glob("*.parquet"))
    written = sorted((tmp_path / "s").glob("*.parquet"))
    assert [p.name for p in written] == [p.name for p in committed] and len(written) == 4
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(written, committed, strict=True))
