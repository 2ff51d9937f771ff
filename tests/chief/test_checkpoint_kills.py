"""Checkpoints written in the background by the ps tasks, with the whole `dtrain run` process group
SIGKILLed (``crash_group``) while parts are being written (at seeded moments after a checkpoint
fell due): every checkpoint with a manifest is complete and verifies (each part's sha256), a directory of parts
without one is never used, and a resume restores exactly what was snapshotted (the resumed run's
model, with no step trained, equals the export of that checkpoint, tables included), with full
checkpoints only and with incremental ones (deltas between)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from dtrain.chief import checkpoint as ckpt
from dtrain.ps.part_writer import read_part_file
from tests.helpers.paths import ROOT
from tests.helpers.runs import crash_group, finish, group_members, start_run, wait_for_step
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.processes

# The 1TB pipeline's 26 tables at 1/40 of their rows (4.7M rows, about 180 MB of parts per
# checkpoint): parts take a while to write, so a kill lands while they are written.
SCALE = 40


def settings(steps: int, incremental: bool = False) -> list[str]:
    import dtrain

    spec = dtrain.load(ROOT / "pipelines" / "dlrm_criteo_1tb.yaml")
    out = [f"model.tables.{name}.num_embeddings={max(1, t.num_embeddings // SCALE)}"
           for name, t in spec.model.tables.items()]
    out += [f"training.steps={steps}", "data.epochs=null", "data.batch_size=128", "summary.every_steps=5",
            "summary.tensorboard=false", "data.test_fraction=0.25",
            "checkpoint={every_steps: 10, keep: 3" + (", incremental: {full_every: 2}}" if incremental else "}")]
    return [a for s in out for a in ("--set", s)]


@pytest.mark.parametrize(("seed", "incremental"), [(0, False), (1, True)])  # (1: the delta of step 30 being written)
def test_a_kill_during_background_writes_leaves_only_whole_checkpoints_that_restore_exactly(tmp_path, seed,
                                                                                          incremental):
    run_dir = tmp_path / "run"
    forkservers = set(Path(tempfile.gettempdir()).glob("pymp-*"))
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "pipelines/dlrm_criteo_1tb.yaml", "--run-dir",
                             str(run_dir), "--quiet", *settings(1000, incremental)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    def running() -> None:
        assert proc.poll() is None, proc.communicate()[1][-3000:]

    # one periodic checkpoint first
    wait_until((run_dir / "checkpoints" / "ckpt-00000010.json").exists, 180, "ckpt-00000010", check=running)
    wait_for_step(proc, run_dir, 20 + 10 * seed)  # then the next one falls due ...
    time.sleep(random.Random(seed).uniform(0.0, 1.0))  # ... and is being written
    crash_group(proc.pid)  # the chief, the scheduler, the ps tasks and their writers
    proc.communicate()
    # Killed with it, the embedded cluster's forkserver could not remove its socket's directory.
    for leftover in set(Path(tempfile.gettempdir()).glob("pymp-*")) - forkservers:
        shutil.rmtree(leftover, ignore_errors=True)
    committed = ckpt.list_checkpoints(run_dir)
    assert committed, "no checkpoint committed before the kill"
    for path in committed:  # every manifest's parts are there, whole
        payload = ckpt.verify(path)
        for part in payload["parts"]:
            read_part_file(path / part["file"], part["bytes"], part["sha256"])
    newest = ckpt.latest(run_dir)
    assert newest.path == committed[-1]

    out = tmp_path / "export"
    code = subprocess.run([sys.executable, "-m", "dtrain.cli", "export", str(run_dir), str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert code.returncode == 0, code.stderr[-2000:]
    if incremental:  # (a delta's export merges its chain in the chief; the resume reads it on the ps tasks)
        assert any(p.get("kind") == "delta" for c in committed for p in ckpt.verify(c)["parts"])
    resumed = start_run("pipelines/dlrm_criteo_1tb.yaml", run_dir, *settings(newest.step, incremental), "--resume")
    rc, _, err = finish(resumed)
    assert rc == 0, err[-3000:]
    model = torch.load(run_dir / "model.pt", weights_only=True)
    exported = torch.load(out / "model.pt", weights_only=True)
    for name, value in exported.items():
        assert torch.equal(model[name], value), name
    import numpy as np

    for name in ("tables.C1.weight", "tables.C10.weight", "tables.C26.weight"):
        stem = name.removesuffix(".weight")
        rows = torch.from_numpy(np.load(out / "tables" / f"{stem}.npy"))
        assert torch.equal(model[name], rows), name  # drawn and undrawn rows alike


def _parts_being_written(run_dir: Path, timeout: float = 180) -> Path:
    """Wait until a checkpoint after the first periodic one has parts being written (a directory
    without its manifest); returns that directory."""
    directory = run_dir / "checkpoints"

    def pending() -> list[Path]:
        return [p for p in directory.glob("ckpt-*") if p.is_dir() and not p.with_suffix(".json").exists()
                and p.name > "ckpt-00000010"] if directory.is_dir() else []

    wait_until(pending, timeout, "a checkpoint being written", every=0.01)
    return pending()[0]


@pytest.mark.parametrize("victim", ["ps", "chief"])
def test_a_ps_or_the_chief_killed_during_a_background_write_costs_only_that_checkpoint(tmp_path, victim):
    """Incremental checkpoints (deltas between full ones), SIGKILL by pid while a checkpoint's parts
    are being written: ps-1 (its writer dies with it; the run recovers from the newest committed
    checkpoint, restoring each chain on the ps tasks, and completes), or the chief (its workers end
    within 15 s, their writers with them; a resume restores the newest committed checkpoint). The
    half-written checkpoint is never committed nor used, and every committed one verifies."""
    run_dir = tmp_path / "run"
    forkservers = set(Path(tempfile.gettempdir()).glob("pymp-*"))
    steps = 60
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "pipelines/dlrm_criteo_1tb.yaml", "--run-dir",
                             str(run_dir), "--quiet", *settings(steps, incremental=True),
                             "--set", "training.call_timeout_s=20", "--set", "training.barrier_timeout_s=30"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        half = _parts_being_written(run_dir)
        target = (json.loads((run_dir / "cluster.json").read_text())["tasks"]["/job:ps/task:1"]["pid"]
                  if victim == "ps" else proc.pid)
        os.kill(int(target), signal.SIGKILL)
        time.sleep(0.5)
        # (ps-1's part done before its kill: the chief may commit the checkpoint, rightly)
        cut = victim == "chief" or not (half / "shard-00001.json").exists()
        if victim == "ps":
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["status"] == "completed" and summary["global_step"] == steps
            rec = summary["recovery_log"][0]
            assert "/job:ps/task:1" in rec["lost"]
            assert rec["restored_step"] < int(half.name.split("-")[1]) or not cut
        else:
            proc.communicate(timeout=60)
            group = group_members(proc.pid)
            _gone, alive = psutil.wait_procs(group, timeout=20)  # (workers end within 15 s of their chief)
            assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            crash_group(proc.pid)
            proc.communicate()
        for leftover in set(Path(tempfile.gettempdir()).glob("pymp-*")) - forkservers:
            shutil.rmtree(leftover, ignore_errors=True)
    committed = ckpt.list_checkpoints(run_dir)
    assert half not in committed or not cut
    for path in committed:  # every manifest's parts, deltas' bases included, whole
        payload = ckpt.verify(path)
        for part in payload["parts"]:
            for f, nbytes, sha in ckpt.part_chain(path, part):
                read_part_file(f, nbytes, sha)
    if victim == "chief":
        newest = ckpt.latest(run_dir)
        # (to a step between checkpoints: its final one is not the half-written one's step, which a
        # checkpoint of the resumed run would write anew)
        resumed = start_run("pipelines/dlrm_criteo_1tb.yaml", run_dir, *settings(newest.step + 5, True), "--resume")
        rc, _, err = finish(resumed)
        assert rc == 0, err[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["start_step"] == newest.step and summary["status"] == "completed"
        assert not half.exists()  # (an unfinished write goes at the next commit)
