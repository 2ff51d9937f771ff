"""Signals to the whole process group, as a terminal's Ctrl-C, a dropped SSH session (SIGHUP) or
systemd's default stop send them: the embedded ps and worker processes get them too, and the run
must still write a consistent checkpoint, its summary, exit 130 (SIGINT) or 143 (SIGTERM,
SIGHUP), and leave no process behind; ``--resume`` then goes on from that checkpoint."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.chief import checkpoint as ckpt
from tests.helpers.orphans import family, purge_dask_scratch, wait_gone
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.processes

STEPS = 1200
SETTINGS = ["--set", f"training.steps={STEPS}", "--set", "checkpoint={every_steps: 100000, keep: 30}",
            "--set", "summary.every_steps=10", "--set", "summary.tensorboard=false", "--set", "eval={}"]


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    """`dtrain run` of the 2-ps sync digits pipeline in a process group of its own (its pid)."""
    return subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "pipelines/digits_sync.yaml", "--run-dir",
                             str(run_dir), "--quiet", *SETTINGS, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            start_new_session=True)


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = [json.loads(x).get("step", -1) for x in path.read_text().splitlines() if x.strip()]
    return max(steps, default=-1)


def group_gone(pgid: int, timeout: float = 30) -> bool:
    """No process of the group is left (the chief, its embedded scheduler's workers, ...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


# CPython's resource tracker (a helper process in the run's group, which joblib's loky import
# renames semaphores for) sometimes prints a KeyError for a semaphore unregistered twice when the
# whole group is signalled: its noise, not the run's.
TRACKER_NOISE = re.compile(r"Traceback \(most recent call last\):\n  File \"[^\"]*multiprocessing/resource_tracker\.py\""
                           r"[^\n]*\n[^\n]*\nKeyError: '/[\w-]+'\n?")


def own(err: str) -> str:
    """stderr without the resource tracker's noise (above)."""
    return TRACKER_NOISE.sub("", err)


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("dtrain-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(900)  # 7 starts of an embedded cluster: ~2 minutes here, much more on a loaded CI machine
def test_signals_to_the_process_group_checkpoint_consistently_and_resume(tmp_path):
    """6 seeded moments of one 2-ps sync run, a resume after each: SIGINT at 4 of them (one while
    its start-up is under way), SIGTERM and SIGHUP once each."""
    rng = random.Random("group-signals")
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    signals = [signal.SIGINT] * 4 + [signal.SIGTERM, signal.SIGHUP]
    rng.shuffle(signals)
    early = set(rng.sample(range(len(signals)), 1))  # a moment before the first step
    resumed_from: int | None = None
    for moment, sig in enumerate(signals):
        (run_dir / "summary.json").unlink(missing_ok=True)
        previous = last_step(run_dir)
        proc = start(run_dir, *(["--resume"] if moment else []))
        if moment in early:
            # From when dtrain's handlers are in place, not after a fixed time: a signal before them
            # (the interpreter's start, the import of dtrain's spec) gets Python's default, the end of
            # a process that has created nothing yet (test_ctrl_c_during_start_up_exits_130...).
            wait_for_handlers(proc)
            time.sleep(rng.uniform(0, 0.5))
            seen = last_step(run_dir) if last_step(run_dir) > previous else None  # this run's own step
        else:
            target = max(previous, 0) + rng.randint(20, 70)
            deadline = time.monotonic() + 180
            while last_step(run_dir) < target:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"moment {moment}: step {target} not reached"
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.05))
            seen = last_step(run_dir)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
        expected = 130 if sig == signal.SIGINT else 143
        assert proc.returncode == expected, f"moment {moment} ({sig.name}): exit {proc.returncode}\n{err[-3000:]}"
        assert "Traceback" not in own(err), err[-3000:]
        assert group_gone(proc.pid), f"moment {moment}: a process of the run outlived it"
        if seen is None and not (run_dir / "summary.json").exists():
            summary = {"status": "interrupted"}  # interrupted before the run started (while importing)
        else:
            summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "interrupted", summary
        newest = ckpt.latest(run_dir)  # verify() refuses a sync checkpoint whose shards disagree
        if seen is not None:
            assert newest is not None and newest.step >= seen, (moment, seen, newest and newest.step)
            assert {sh["step"] for sh in newest.payload["shards"]} == {newest.step}
            assert summary["checkpoints"] and summary["checkpoints"][-1] == newest.path.name
            assert summary["start_step"] == (resumed_from or 0)
            assert "checkpoint ckpt-" in err and "--resume" in err
        resumed_from = newest.step if newest is not None else 0
    proc = start(run_dir, "--resume")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == STEPS
    assert summary["start_step"] == resumed_from
    assert summary["eval"]["accuracy"] >= 0.9
    assert group_gone(proc.pid)
    assert shm_files() <= shm_before


ASYNC = ["--set", "checkpoint={every_steps: 100000}", "--set", "summary.every_steps=20", "--set",
         "summary.tensorboard=false", "--set", "training.steps=100000"]


def start_async(run_dir: Path, *extra: str, prelude: str = "") -> subprocess.Popen:
    """`dtrain run` of the async digits pipeline; ``prelude`` runs in the chief first (fault injection)."""
    code = f"{prelude}\nimport sys\nfrom dtrain.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, "run", "pipelines/digits_async.yaml", "--run-dir",
                             str(run_dir), "--quiet", *ASYNC, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            start_new_session=True)


def wait_step(proc: subprocess.Popen, run_dir: Path, step: int) -> int:
    deadline = time.monotonic() + 180
    while last_step(run_dir) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return last_step(run_dir)


def test_a_run_directory_in_use_is_refused_and_a_second_sigterm_waits_for_the_cleanup(tmp_path):
    run_dir = tmp_path / "run"
    # The cleanup (checkpoint, summary, the cluster's shutdown) takes well under 0.3 s now: a slow
    # shutdown keeps it going when the second SIGTERM comes.
    prelude = ("import time\nimport dtrain.deploy.cluster as c\nclose = c.Connection.close\n"
               "c.Connection.close = lambda self: (time.sleep(1.5), close(self))[1]\n")
    proc = start_async(run_dir, prelude=prelude)
    seen = wait_step(proc, run_dir, 60)
    # A second run on the same directory: refused at once (exit 2), the first one untouched.
    other = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml", "--run-dir",
                            str(run_dir), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and "in use by another run" in other.stderr, other.stderr
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)  # impatient: must not cut the checkpoint and summary short
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "terminated (SIGTERM)"
    newest = ckpt.latest(run_dir)
    assert newest is not None and newest.step >= seen and summary["checkpoints"][-1] == newest.path.name
    assert "during the cleanup" in err
    assert group_gone(proc.pid)


def test_a_full_disk_for_the_summary_keeps_the_exit_code_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    prelude = """
import errno
import dtrain.chief.session as session
real = session.write_json
def write_json(path, obj):
    if path.name == "summary.json":
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(path, obj)
session.write_json = write_json
"""
    proc = start_async(run_dir, prelude=prelude)
    wait_step(proc, run_dir, 40)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    assert "could not write" in err and "No space left on device" in err
    assert ckpt.latest(run_dir) is not None  # the interrupt checkpoint was still written
    assert group_gone(proc.pid)


def catches_sigterm(pid: int) -> bool:
    """Whether the process has its own SIGTERM handler yet (``dtrain run`` installs it as it starts:
    a signal before that gets Python's own behaviour, not dtrain's)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def wait_for_handlers(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not catches_sigterm(proc.pid):
        assert time.monotonic() < deadline and proc.poll() is None, "dtrain run never installed its handlers"
        time.sleep(0.01)


def test_ctrl_c_during_start_up_exits_130_never_by_the_signal(tmp_path):
    """A Ctrl-C at three moments of `dtrain run`'s start-up, from when its handlers are in place:
    exit 130 and nothing left behind (the moment that once exited -2 is narrow: the next test
    reproduces its cause deterministically). Before the handlers (Python's start and the import
    of dtrain's spec modules, about 0.2 s) nothing of the run exists yet and a signal has Python's
    default effect: the process ends by it, which a shell reports as 130 or 143 too."""
    for i, delay in enumerate([0.0, 0.6, 1.2]):
        proc = start(tmp_path / f"run-{i}")
        wait_for_handlers(proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, f"{delay} s after start-up: exit {proc.returncode}\n{own(err)[-2000:]}"
        assert group_gone(proc.pid), "a process of the run outlived it"


def test_an_interrupt_raised_inside_eval_still_exits_130(tmp_path):
    """CPython marks a KeyboardInterrupt raised inside eval/exec of a string as unhandled even when
    it is caught, then ends the process with SIGINT (-2) instead of its exit code (when run as
    ``-m`` or a script, as `dtrain` is); `import torch` runs such evals (namedtuples, dataclasses),
    so a Ctrl-C there exited -2. cli._exit_now leaves with os._exit: this fails (-2) without it."""
    (tmp_path / "interrupted_cli.py").write_text(
        "import sys\nimport dtrain.cli as cli\n"
        "cli.cmd_validate = lambda args: eval('exec(\"raise KeyboardInterrupt\")')\n"
        "sys.exit(cli.main(['validate', 'any.yaml']))\n")
    proc = subprocess.run([sys.executable, "-m", "interrupted_cli"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp_path}"))
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().endswith("dtrain: interrupted")


def test_a_third_signal_ends_the_process_at_once(tmp_path):
    """Three SIGINTs to the chief: the first begins the cleanup, the second is counted, the third
    ends the process at once (exit 130) even though the cluster's shutdown is not done (held here
    for 120 s), the summary written before it. The embedded workers, orphaned, exit by themselves
    within their death timeout. Fails if the signals are counted per cleanup step only (the
    cluster's shutdown, a step of its own, then needs three more)."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "closing"
    prelude = ("import time, pathlib\nimport dtrain.deploy.cluster as c\n"
               f"c.Connection.close = lambda self: (pathlib.Path({str(marker)!r}).touch(), time.sleep(120))\n")
    proc = start_async(run_dir, prelude=prelude)
    wait_step(proc, run_dir, 20)
    os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while not marker.exists():  # the checkpoint and summary written, the cluster's shutdown begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    t_third = time.monotonic()
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 130 and time.monotonic() - t_third < 10, (proc.returncode, own(err)[-3000:])
    assert "during the cleanup" in err and "exiting now" in err, err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert group_gone(proc.pid, timeout=15 + 15), "an orphaned worker outlived its death timeout"
    purge_dask_scratch()  # their work directories, as the next Dask start on this machine does


def test_the_processes_of_a_killed_chief_exit_within_15_s(tmp_path):
    """SIGKILL `dtrain run` mid-training: its embedded workers (re-parented to init), its
    forkserver and the rest of its process tree exit by themselves within 15 s, leaving no
    shared-memory file."""
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    proc = start_async(run_dir)
    wait_step(proc, run_dir, 20)
    tasks = {int(t["pid"]) for t in json.loads((run_dir / "cluster.json").read_text())["tasks"].values()}
    started = family(proc.pid)
    assert tasks <= set(started), (tasks, started)  # (the workers are the chief's descendants)
    del started[proc.pid]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    left = wait_gone(started, timeout=15)
    assert not left, f"still running 15 s after the chief was killed: {left}"
    assert shm_files() <= shm_before
    purge_dask_scratch()
