"""Sharded datasets streamed by the replicas, end to end on the shared in-process cluster: the
pipeline, exactly once per epoch with data.epochs and no training.steps, a Dask collection through
the Python API, and a file that turns bad mid-run (failing after a checkpoint, or skipped)."""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np
import pytest

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.errors import RunError
from dtrain.plan.inputs import assign_shards
from tests.helpers import shards
from tests.helpers.paths import PIPELINES


def spec_for(data_dir, text="", **kw) -> dtrain.PipelineSpec:
    base = f"""
name: stream
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model: {{module: "tests.helpers.models:RecordingMLP", kwargs: {{features: 4, classes: 2}}}}
data: {{source: "{data_dir}/train/*.parquet", eval_source: "{data_dir}/eval/*.parquet", batch_size: 16,
        standardize: false, shuffle_buffer: 64, epochs: 2}}
optimizer: {{name: sgd, lr: 0.05}}
training: {{mode: {kw.get("mode", "sync")}}}
summary: {{every_steps: 5, tensorboard: false}}
"""
    return dtrain.loads(base + text, base_dir=".")


def recorded(directory) -> dict[str, list[list[int]]]:
    return {p.stem: [[int(v) for v in line.split()] for line in p.read_text().splitlines()]
            for p in sorted(directory.glob("*.txt"))}


@pytest.fixture
def data_dir(tmp_path):
    shards.write(tmp_path / "train", [300, 170, 230, 60, 90])  # replicas: 400 and 450 rows
    shards.write(tmp_path / "eval", [100], start=10_000)
    return tmp_path


def test_stream_parquet_pipeline_learns_with_two_replicas(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINES / "stream_parquet.yaml", overrides=["checkpoint=null", "summary.tensorboard=false"])
    plan = dtrain.compile(spec, data=None)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    per_epoch = [r.rows // 64 for r in result.plan.data.replicas]
    assert s["status"] == "completed" and s["epochs"] == 3.0 and plan.num_replicas == 2
    assert s["global_step"] == 3 * max(per_epoch) and s["samples"] == 3 * 64 * sum(per_epoch)
    assert s["eval"]["accuracy"] >= 0.9  # blobs 4 apart: a learnable target, held-out row groups
    assert s["data"] == {"source": "data/stream/", "shards": 10, "rows": 10000, "eval_shards": 2}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_epochs_without_steps_read_every_sample_exactly_twice(inproc_client, data_dir, tmp_path, monkeypatch,
                                                                  mode):
    record = tmp_path / "seen"
    record.mkdir()
    monkeypatch.setenv("DTRAIN_TEST_RECORD", str(record))
    spec = spec_for(data_dir, mode=mode)
    assert spec.training.steps >= 2**62  # unbounded: the data's end ends the run
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    groups = assign_shards([300, 170, 230, 60, 90], 2)
    rows = [sum([300, 170, 230, 60, 90][i] for i in g) for g in groups]
    assert sorted(rows) == [400, 450]  # uneven: in sync the replica with less data retires first
    seen = recorded(record)
    assert sorted(len(b) for b in seen.values()) == sorted(2 * (n // 16) for n in rows)
    counts = collections.Counter(i for batches in seen.values() for b in batches for i in b)
    assert set(counts.values()) <= {1, 2} and max(counts) < 850  # never twice in an epoch, never an eval sample
    not_twice = 850 - sum(1 for c in counts.values() if c == 2)
    assert not_twice <= 2 * sum(n % 16 for n in rows)  # only each replica's partial last batch, per epoch
    assert s["status"] == "completed" and s["epochs"] == 2.0
    assert s["samples"] == sum(len(b) for batches in seen.values() for b in batches)
    if mode == "sync":
        assert s["global_step"] == 2 * max(n // 16 for n in rows)


def test_a_dask_dataframe_from_parquet_trains_end_to_end(inproc_client, data_dir, tmp_path):
    dd = pytest.importorskip("dask.dataframe")
    ddf = dd.read_parquet(str(data_dir / "train"))
    spec = dtrain.loads("""
name: collection
cluster: {jobs: {ps: 1, worker: 2}}
model: {input_shape: [4], layers: [{type: linear, out: 16}, {type: relu}, {type: linear, out: 2}],
        loss: cross_entropy}
data: {batch_size: 16, epochs: 2, test_fraction: 0.2}
optimizer: {name: sgd, lr: 0.1}
training: {mode: async}
summary: {every_steps: 5, tensorboard: false}
""")
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run", data=ddf)
    s = result.summary
    assert s["status"] == "completed" and s["epochs"] == 2.0
    assert s["data"]["source"] == "dask-collection" and s["data"]["shards"] + s["data"]["eval_shards"] == 5
    assert s["eval"]["accuracy"] >= 0.9
    assert s["samples"] == sum(2 * (r.rows // 16) * 16 for r in result.plan.data.replicas)


def test_dask_arrays_train_end_to_end(inproc_client, tmp_path):
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 600)
    x = rng.standard_normal((600, 3)) + 2.0 * (2 * y[:, None] - 1)
    spec = dtrain.loads("""
cluster: {jobs: {ps: 1, worker: 2}}
model: {input_shape: [3], layers: [{type: linear, out: 2}], loss: cross_entropy}
data: {batch_size: 20, epochs: 1}
optimizer: {name: sgd, lr: 0.1}
summary: {tensorboard: false}
""")
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run",
                        data=(da.from_array(x, chunks=100), da.from_array(y, chunks=100)))
    assert result.summary["status"] == "completed" and result.summary["eval"]["accuracy"] >= 0.9


def _corrupt_when(run_dir, step, path, done):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            path.write_bytes(b"PAR1 this file was truncated PAR1")
            return
        time.sleep(0.02)


@pytest.mark.parametrize("skip", [False, True])
def test_a_file_that_turns_bad_mid_run_fails_naming_it_after_a_checkpoint_or_is_skipped(
        inproc_client, data_dir, tmp_path, skip):
    spec = spec_for(data_dir, "checkpoint: {every_steps: 10}\n", mode="sync")
    spec.training.barrier_timeout_s = 15
    spec.data.epochs = 6
    spec.data.skip_bad_files = skip
    run_dir = tmp_path / "run"
    bad = data_dir / "train" / "part-002.parquet"
    done = threading.Event()
    corrupter = threading.Thread(target=_corrupt_when, args=(run_dir, 30, bad, done), daemon=True)
    corrupter.start()
    try:
        if not skip:
            with pytest.raises(RunError, match="part-002.parquet") as err:
                dtrain.run(spec, client=inproc_client, run_dir=run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["status"] == "failed" and "part-002.parquet" in summary["error"]
            latest = ckpt.latest(run_dir)  # the last good step is kept: --resume continues from it
            assert latest is not None and latest.step == summary["global_step"] and latest.step >= 30
            assert "cannot be read" in str(err.value)
        else:
            result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
            s = result.summary
            assert s["status"] == "completed" and s["bad_files"] == ["part-002.parquet#rg0"]
            assert s["epochs"] == 6.0
    finally:
        done.set()
        corrupter.join()


def test_sparse_table_model_streams_integer_ids_from_npz_shards(inproc_client, tmp_path):
    """A click-through model whose table lives on the ps, fed by streamed npz shards of ids."""
    from dtrain.data.ctr import make_ctr

    x, y = make_ctr(6000, 8, 2000, seed=0)
    (tmp_path / "ctr").mkdir()
    for i in range(4):
        np.savez(tmp_path / "ctr" / f"part-{i}.npz", x=x[i * 1500:(i + 1) * 1500], y=y[i * 1500:(i + 1) * 1500])
    spec = dtrain.loads(f"""
cluster: {{jobs: {{ps: 2, worker: 2}}}}
model:
  input_shape: [8]
  layers: [{{type: embedding, num_embeddings: 2000, dim: 8, init_std: 0.1}}, {{type: flatten}},
           {{type: linear, out: 1}}]
  loss: bce_with_logits
data: {{source: "{tmp_path}/ctr/", batch_size: 64, epochs: 1, test_fraction: 0.25}}
optimizer: {{name: adagrad, lr: 0.1}}
training: {{mode: sync}}
summary: {{every_steps: 5, tensorboard: false}}
""")
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    s = result.summary
    assert s["status"] == "completed" and s["epochs"] == 1.0
    assert s["global_step"] == max(r.rows // 64 for r in result.plan.data.replicas) == 3000 // 64
    assert s["eval"]["accuracy"] > 0.6 and result.plan.tables and result.plan.data.format == "npz"


def test_a_resume_whose_data_changed_is_refused_naming_the_difference(inproc_client, data_dir, tmp_path):
    """A checkpoint's positions index the files, batch size and shuffle window it was written under:
    a file added since, or another batch size, would make the resumed replicas repeat or skip
    samples silently. The resume is refused, naming the first difference; with the data as it was
    it resumes."""
    def spec(steps: int, batch: int = 16) -> dtrain.PipelineSpec:
        data = spec_for(data_dir, "checkpoint: {every_steps: 5}\n").model_dump(mode="json")
        data["training"]["steps"], data["data"]["batch_size"] = steps, batch
        return dtrain.PipelineSpec.model_validate(data)

    run_dir = tmp_path / "run"
    first = dtrain.run(spec(12), client=inproc_client, run_dir=run_dir)
    assert first.summary["checkpoints"][-1] == "ckpt-00000012"
    with pytest.raises(RunError, match=r"cannot resume from ckpt-00000012: replica 0 took batches of 16 when it was "
                                       r"written and would now use 32"):
        dtrain.run(spec(20, batch=32), client=inproc_client, run_dir=run_dir, resume=True)
    extra = shards.write(tmp_path / "extra", [120], start=50_000)[0]
    added = data_dir / "train" / "part-009.parquet"
    added.write_bytes(extra.read_bytes())
    with pytest.raises(RunError, match=r"replica \d read the files .* when it was written and would now read"):
        dtrain.run(spec(20), client=inproc_client, run_dir=run_dir, resume=True)
    added.unlink()
    again = dtrain.run(spec(20), client=inproc_client, run_dir=run_dir, resume=True)
    assert again.summary["status"] == "completed" and again.summary["start_step"] == 12
