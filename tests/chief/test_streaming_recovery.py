"""A streaming run killed with SIGKILL and resumed: every replica continues where its data stopped,
so across the two runs every sample is read exactly data.epochs times (real worker processes)."""

from __future__ import annotations

import collections
import json
import os

import pytest

from dtrain.chief import checkpoint as ckpt
from dtrain.plan.inputs import assign_shards
from tests.helpers import shards
from tests.helpers.runs import finish, kill_pid, start_run, task_pid, wait_for_step
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.processes

ROWS = [5000, 3100, 4100, 1900, 2400]


def pipeline(tmp_path) -> str:
    shards.write(tmp_path / "train", ROWS)
    shards.write(tmp_path / "eval", [200], start=100_000)
    path = tmp_path / "stream.yaml"
    path.write_text(f"""
name: stream-resume
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model: {{module: "tests.helpers.models:RecordingMLP", kwargs: {{features: 4, classes: 2}}}}
data: {{source: "{tmp_path}/train/", eval_source: "{tmp_path}/eval/", batch_size: 16, standardize: false,
        shuffle_buffer: 500, epochs: 2}}
optimizer: {{name: sgd, lr: 0.05}}
training: {{mode: sync}}
checkpoint: {{every_steps: 50, keep: 2}}
summary: {{every_steps: 5, tensorboard: false}}
""")
    return str(path)


def batches_by_task(record, run_dir) -> dict[str, list[list[int]]]:
    """Each replica's recorded batches, by worker task (its process id from cluster.json)."""
    pids = {str(v["pid"]): task for task, v in json.loads((run_dir / "cluster.json").read_text())["tasks"].items()}
    out: dict[str, list[list[int]]] = {}
    for path in record.glob("*.txt"):
        pid = path.stem.split("-")[0]
        if pid in pids:
            out[pids[pid]] = [[int(v) for v in line.split()] for line in path.read_text().splitlines()]
    return out


def test_a_killed_streaming_run_resumes_without_repeating_or_skipping(tmp_path, monkeypatch):
    path = pipeline(tmp_path)
    run_dir = tmp_path / "run"
    first, second = tmp_path / "seen-1", tmp_path / "seen-2"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("DTRAIN_TEST_RECORD", str(first))
    proc = start_run(path, run_dir)
    wait_for_step(proc, run_dir, 330)  # past a few checkpoints, mid-way through the first epoch... or the second
    # ... and step 300's checkpoint committed (written in the background: on a loaded machine its
    # manifest can come some steps after step 330)
    wait_until(lambda: (c := ckpt.latest(run_dir)) is not None and c.step >= 300, 120, "checkpoint 300 committed",
               check=lambda: None if proc.poll() is None else pytest.fail(f"the run ended: {proc.communicate()[1][-2000:]}"))
    kill_pid(proc.pid)  # the client process: scheduler and nannies die with it
    proc.communicate()
    killed = batches_by_task(first, run_dir)
    latest = ckpt.latest(run_dir)
    assert latest is not None and latest.step >= 300
    places = latest.payload["replicas"]["data"]
    assert set(places) == {"0", "1"}
    for place in places.values():  # the position names its epoch, shard and row
        assert set(place) == {"position", "epoch", "batch", "shard", "offset"} and ".parquet" in place["shard"]
    monkeypatch.setenv("DTRAIN_TEST_RECORD", str(second))
    code, out, err = finish(start_run(path, run_dir, "--resume"))
    assert code == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["start_step"] == latest.step and summary["epochs"] == 2.0
    resumed = batches_by_task(second, run_dir)
    rows = [sum(ROWS[i] for i in g) for g in assign_shards(ROWS, 2)]
    assert rows == [7400, 9100]  # 8 and 12 samples left over per epoch
    counts: collections.Counter = collections.Counter()
    for r in ("0", "1"):
        task = f"/job:worker/task:{r}"
        before = killed[task][:places[r]["position"]]  # what the checkpoint holds of the killed run
        assert len(before) == places[r]["position"] and len(killed[task]) > len(before)
        assert len(before) + len(resumed[task]) == 2 * (rows[int(r)] // 16)  # every batch of both epochs, once
        counts.update(i for b in before + resumed[task] for i in b)
    assert set(counts.values()) <= {1, 2} and max(counts) < 100_000
    # Only the samples of each replica's partial last batch of each epoch are read less than twice:
    # nothing repeated, nothing skipped beyond it.
    tails = sum(n % 16 for n in rows)
    assert tails <= sum(ROWS) - sum(1 for c in counts.values() if c == 2) <= 2 * tails
    assert os.path.exists(run_dir / "model.pt")


def test_a_lost_worker_resumes_its_stream_where_it_stopped(tmp_path, monkeypatch):
    """Sync: a worker killed mid-epoch is restarted from the ps's step; the run still ends at the
    end of both epochs, its replica repeating or skipping at most the batch it was computing."""
    path = pipeline(tmp_path)
    run_dir = tmp_path / "run"
    record = tmp_path / "seen"
    record.mkdir()
    monkeypatch.setenv("DTRAIN_TEST_RECORD", str(record))
    proc = start_run(path, run_dir, "--set", "checkpoint=null")
    wait_for_step(proc, run_dir, 250)
    before = json.loads((run_dir / "cluster.json").read_text())
    kill_pid(task_pid(run_dir, "/job:worker/task:1"))
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["recoveries"] == 1 and summary["epochs"] == 2.0
    rows = [sum(ROWS[i] for i in g) for g in assign_shards(ROWS, 2)]
    pids = {str(v["pid"]) for v in before["tasks"].values()}
    counts: collections.Counter = collections.Counter()
    per_process = {}
    for p in record.glob("*.txt"):
        per_process[p.stem] = [[int(v) for v in line.split()] for line in p.read_text().splitlines()]
        counts.update(i for b in per_process[p.stem] for i in b)
    assert len(per_process) == 3 and sum(1 for k in per_process if k.split("-")[0] in pids) == 2  # + the new one
    tails = sum(n % 16 for n in rows)
    assert sum(1 for c in counts.values() if c > 2) <= 16  # at most the lost replica's batch in flight, again
    assert sum(1 for c in counts.values() if c < 2) <= 2 * tails + 16  # ... or skipped
