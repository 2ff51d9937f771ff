"""Chaos: a sync and an async digits run with checkpoints, each while a seeded schedule SIGKILLs a
random ps or worker process 5 times. Every run completes all its steps, every recovery loses at
most one checkpoint interval, accuracy stays within 0.02 of an undisturbed run, and no process
or /dev/shm file is left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dtrain
from tests.helpers.hooks import read_calls
from tests.helpers.paths import PIPELINES, ROOT
from tests.helpers.runs import crash_group, group_members
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.processes

EVERY = 100
KILLS = 5
SETTINGS = {
    "sync": ["--set", "training.steps=1500", "--set", "eval={}"],
    "async": ["--set", "training.steps=2500"],
}
COMMON = ["--set", f"checkpoint={{every_steps: {EVERY}, keep: 3}}", "--set", "summary.every_steps=25",
          "--set", "summary.tensorboard=false", "--set", "training.max_recoveries=10",
          "--set", "training.barrier_timeout_s=30", "--set", "training.call_timeout_s=60"]


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("dtrain-")} if os.path.isdir("/dev/shm") else set()


def metrics_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    return max((json.loads(x).get("step", -1) for x in path.read_text().splitlines() if x.strip()), default=-1)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_five_random_kills_during_a_run(inproc_client, tmp_path, mode):
    pipeline = PIPELINES / f"digits_{mode}.yaml"
    overrides = [*SETTINGS[mode][1::2], "summary.tensorboard=false"]
    calm = dtrain.run(dtrain.load(pipeline, overrides=overrides), client=inproc_client, run_dir=tmp_path / "calm")
    calm_accuracy = calm.summary["eval"]["accuracy"]

    rng = random.Random(f"chaos-{mode}")
    kinds = ["ps", "worker"] + [rng.choice(["ps", "worker"]) for _ in range(KILLS - 2)]  # both kinds, always
    rng.shuffle(kinds)
    shm_before = shm_files()
    run_dir = tmp_path / "run"
    calls = tmp_path / "calls.jsonl"
    hooks = ("hooks=[{type: nan_guard}, {type: 'tests.helpers.hooks:RecordingHook', args: {path: '"
             + str(calls) + "'}}]")
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", str(pipeline), "--run-dir", str(run_dir),
                             "--quiet", *SETTINGS[mode], *COMMON, "--set", hooks], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            start_new_session=True)
    killed: list[tuple[str, int, int]] = []  # (task, pid, step seen before the kill)

    def running() -> None:
        assert proc.poll() is None, proc.communicate()[1][-4000:]

    try:
        step = 0
        for kind in kinds:
            step = max(step, metrics_step(run_dir)) + rng.randint(60, 160)  # after the last recovery's restart
            wait_until(lambda step=step: metrics_step(run_dir) >= step, 240, f"step {step} (killed so far: {killed})",
                       check=running)
            info = json.loads((run_dir / "cluster.json").read_text())
            task = rng.choice(sorted(k for k in info["tasks"] if k.startswith(f"/job:{kind}/")))
            pid = int(info["tasks"][task]["pid"])
            killed.append((task, pid, metrics_step(run_dir)))
            os.kill(pid, signal.SIGKILL)
            # the next kill comes once this one is recovered: the chief rewrote cluster.json
            wait_until(lambda task=task, pid=pid: json.loads((run_dir / "cluster.json").read_text())["tasks"][task]["pid"]
                       != pid, 180, f"{task} recovered", every=0.1, check=running)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            crash_group(proc.pid)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = int(SETTINGS[mode][1].split("=")[1])
    assert summary["status"] == "completed" and summary["global_step"] >= steps
    assert summary["recoveries"] == KILLS == len(summary["recovery_log"])
    dp = summary["data_plane"]  # separate processes: a sync replica maps its ps's memfd through /proc
    assert dp["in_place_connections"] == (dp["shared_memory_connections"] if mode == "sync" else 0), dp
    assert dp["shared_memory_connections"] >= (4 if os.path.isdir("/dev/shm") else 0), dp
    for (task, _pid, seen), rec in zip(killed, summary["recovery_log"], strict=True):
        assert rec["lost"] == [task], (killed, summary["recovery_log"])
        if task.startswith("/job:ps/"):
            # At most one checkpoint interval lost. The shards pause at every multiple of EVERY until
            # the chief has its snapshot, so once a step past a multiple was seen, that multiple's
            # checkpoint existed: the restore comes from it or a newer one, never an older one or
            # step 0 (at exactly a multiple the chief may still be writing it). `step` is the global
            # step when the loss was seen.
            # A kill while the checkpoint at the multiple just reached was still being written (in
            # the background, training going on) costs that checkpoint: the one before is restored,
            # and the steps since that snapshot are lost too (docs/session.md, the failure model).
            assert rec["restored_step"] % EVERY == 0 and rec["restored_step"] >= (seen - 1) // EVERY * EVERY, rec
            assert rec["step"] >= seen, rec
            if rec["restored_step"] < seen // EVERY * EVERY:  # that checkpoint was lost, and only that one
                assert rec["restored_step"] == seen // EVERY * EVERY - EVERY, rec
            else:
                assert 0 <= rec["step"] - rec["restored_step"] <= EVERY, rec
        else:  # a replica restarts from the ps's current parameters: nothing lost
            assert rec["restored_step"] is None
    assert summary["eval"]["accuracy"] >= calm_accuracy - 0.02, (summary["eval"], calm_accuracy)
    assert [v for e, v in read_calls(calls) if e == "on_task_lost"] == [task for task, _, _ in killed]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        alive = [p.pid for p in group_members(proc.pid) if p.pid != os.getpid()]
        raise AssertionError(f"processes left behind: {alive}")
    assert shm_files() <= shm_before
