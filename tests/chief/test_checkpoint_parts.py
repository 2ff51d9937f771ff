"""Checkpoints written by the ps tasks (chief/checkpoint.py, ps/part_writer.py), on the in-process
cluster: one part per task and a manifest that commits them; a part found corrupt where it is
read (on its ps task) moves the checkpoint aside and the previous one is restored; a directory
without a manifest (a write cut short) does not exist and goes at the next commit; and a
checkpoint of the older single-file format still restores, to the same result; an evaluation on a
checkpoint's step that outlasts the barrier timeout costs no recovery (the shards are held for the
snapshot only)."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.chief.rundir import check_run_dir
from tests.helpers.pipelines import pipeline_yaml


def spec_text(steps: int = 40, ps: int = 2, every: int = 20) -> str:
    return pipeline_yaml("ckpt-parts", jobs={"ps": ps, "worker": 2},
                         data={"source": "sklearn:digits", "batch_size": 16, "shuffle": False},
                         optimizer={"name": "momentum", "lr": 0.05}, mode="sync", steps=steps,
                         summary={"every_steps": every, "tensorboard": False},
                         checkpoint={"every_steps": every, "keep": 3})


def _spec(steps: int) -> dtrain.PipelineSpec:
    return dtrain.loads(spec_text(steps), base_dir=".")


def test_each_ps_task_writes_its_part_and_the_manifest_commits_them(inproc_client, run_dir):
    s = dtrain.run(_spec(40), client=inproc_client, run_dir=run_dir).summary
    assert s["status"] == "completed" and s["checkpoints"] == ["ckpt-00000000", "ckpt-00000020", "ckpt-00000040"]
    assert s["checkpoint_waits"] >= 0 and s["checkpoint_stall_s"] > 0
    directory = ckpt.checkpoint_dir(run_dir)
    assert sorted(p.name for p in directory.iterdir()) == [
        "ckpt-00000000", "ckpt-00000000.json", "ckpt-00000020", "ckpt-00000020.json", "ckpt-00000040",
        "ckpt-00000040.json"]  # no temp file, no leftover directory
    manifest = json.loads((directory / "ckpt-00000040.json").read_text())
    assert manifest["format"] == ckpt.PARTS_FORMAT and manifest["step"] == 40 and manifest["dir"] == "ckpt-00000040"
    assert [p["shard"] for p in manifest["parts"]] == [0, 1]
    for part in manifest["parts"]:  # each entry describes its file: a part the manifest misnames fails this
        data = (directory / "ckpt-00000040" / part["file"]).read_bytes()
        assert part["bytes"] == len(data) and part["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in (directory / "ckpt-00000040").iterdir()) == [
        "shard-00000.json", "shard-00000.pt", "shard-00001.json", "shard-00001.pt"]  # each part and its report
    newest = ckpt.latest(run_dir)
    assert newest.step == 40 and newest.parts == manifest["parts"]
    assert [sh["step"] for sh in newest.payload["shards"]] == [40, 40]  # each part at the checkpoint's step
    # The parts hold what the run ended with (model.pt is pulled from the ps tasks, not the checkpoint).
    final = torch.load(run_dir / "model.pt", weights_only=True)
    flat = torch.cat([sh["params"] for sh in newest.payload["shards"]])
    assert sorted(flat.tolist()) == sorted(torch.cat([v.flatten() for v in final.values()]).tolist())


@pytest.mark.parametrize("ps", [2, 3])  # (3: resharded, each file checked once by one of the new ps tasks)
def test_a_corrupt_part_moves_its_checkpoint_aside_and_the_previous_one_is_restored(inproc_client, run_dir,
                                                                                    caplog, ps):
    """One byte of the newest checkpoint's second part flipped (same size: only a ps task, which
    checks the sha256 before it reads a part, can tell): the resume moves that checkpoint into
    invalid/ and continues from the previous one, to the same end as from a clean directory."""
    dtrain.run(_spec(40), client=inproc_client, run_dir=run_dir)
    part = ckpt.checkpoint_dir(run_dir) / "ckpt-00000040" / "shard-00001.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    assert ckpt.latest(run_dir).step == 40  # the chief checks sizes only: the ps task finds it
    with caplog.at_level(logging.WARNING, logger="dtrain.chief.saver"):
        # (on 3 ps tasks every 30 steps: what the text it was once written as, SPEC.replace("ps: 2",
        # "ps: 3"), made of "every_steps: 20" too)
        spec = _spec(60) if ps == 2 else dtrain.loads(spec_text(60, ps=3, every=30),
                                                       base_dir=".")
        s = dtrain.run(spec, client=inproc_client, run_dir=run_dir, resume=True).summary
    assert s["status"] == "completed" and s["start_step"] == 20 and s["global_step"] == 60
    assert s["ps_tasks"] == [f"/job:ps/task:{i}" for i in range(ps)]
    assert "ckpt-00000040 is invalid" in caplog.text and "sha256 mismatch" in caplog.text
    assert (ckpt.checkpoint_dir(run_dir) / "invalid" / "ckpt-00000040").is_dir()
    assert (ckpt.checkpoint_dir(run_dir) / "invalid" / "ckpt-00000040.json").is_file()


def test_a_checkpoint_without_its_manifest_does_not_exist(inproc_client, run_dir):
    """A directory of parts whose manifest was never written (the chief died before every part
    was durable): not listed, not resumed from, not counted as a checkpoint of the run directory,
    and removed at the next commit."""
    dtrain.run(_spec(40), client=inproc_client, run_dir=run_dir)
    directory = ckpt.checkpoint_dir(run_dir)
    cut = directory / "ckpt-00000060"
    cut.mkdir()
    (cut / "shard-00000.pt").write_bytes(b"half a part")
    assert [p.name for p in ckpt.list_checkpoints(run_dir)][-1] == "ckpt-00000040"
    assert ckpt.latest(run_dir).step == 40
    s = dtrain.run(_spec(50), client=inproc_client, run_dir=run_dir, resume=True).summary
    assert s["start_step"] == 40 and s["checkpoints"] == ["ckpt-00000050"]
    assert not cut.exists()
    # A run directory holding only an unfinished one is not a run directory with checkpoints.
    other = run_dir.parent / "other"
    (other / "checkpoints" / "ckpt-00000010").mkdir(parents=True)
    check_run_dir(other, resume=False)


def test_a_single_file_checkpoint_of_earlier_versions_still_restores(inproc_client, tmp_path):
    """The step-20 checkpoint rewritten in the single-file format (format 1): resuming from it ends
    exactly where resuming from the parts does."""
    first = tmp_path / "first"
    dtrain.run(_spec(20), client=inproc_client, run_dir=first)
    newest = ckpt.latest(first)
    old = tmp_path / "old"
    path = ckpt.save(old, 20, newest.payload["shards"], spec_data=newest.payload["spec"],
                     pipeline_hash=newest.payload["pipeline_hash"], replicas=newest.payload["replicas"],
                     layout=newest.payload["layout"])
    assert path.name == "ckpt-00000020.pt" and ckpt.latest(old).parts is None
    a = dtrain.run(_spec(30), client=inproc_client, run_dir=first, resume=True)
    b = dtrain.run(_spec(30), client=inproc_client, run_dir=old, resume=True)
    assert a.summary["start_step"] == b.summary["start_step"] == 20
    assert b.summary["checkpoints"] == ["ckpt-00000030"]  # and it goes on in the new format
    for name, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[name]), name


def test_an_evaluation_on_a_checkpoint_step_longer_than_the_barrier_timeout_costs_no_recovery(inproc_client,
                                                                                             run_dir):
    """The shards pause at step 20 for the checkpoint; the evaluation of step 20 takes 2.5 s, the
    replicas' barrier timeout is 1 s. Fails if the hold lasts through the evaluation (the
    replicas' pushes then time out and the run recovers or fails)."""
    spec = dtrain.loads(pipeline_yaml(
        "slow-eval", model={"module": "tests.helpers.models:SlowEval", "kwargs": {"sleep_s": 2.5}},
        optimizer={"name": "sgd", "lr": 0.05}, training={"mode": "sync", "steps": 40, "barrier_timeout_s": 1.0},
        summary={"every_steps": 20, "tensorboard": False}, eval={"every_steps": 20},
        checkpoint={"every_steps": 20}), base_dir=".")
    s = dtrain.run(spec, client=inproc_client, run_dir=run_dir).summary
    assert s["status"] == "completed" and s["global_step"] == 40
    assert s["recoveries"] == 0 and not s["recovery_log"]
    assert "ckpt-00000020" in s["checkpoints"]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval" in r][0] == 20  # the evaluation of step 20 did run
