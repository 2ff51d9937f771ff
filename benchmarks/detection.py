#!/usr/bin/env python
"""How soon the chief sees a lost task: SIGKILL a ps or worker process of a running `dtrain run`.

Usage (from the repository root)::

    python benchmarks/detection.py               # 10 kills of a ps process, 10 of a worker process
    python benchmarks/detection.py --kills 3     # fewer

One ``dtrain run pipelines/digits_async.yaml`` (2 ps and 2 worker processes on the embedded
cluster, as `dtrain run` starts it; a checkpoint every 50 steps) trains while this script kills,
in turn, a ps process and a worker process (``os.kill(pid, SIGKILL)``, the pid from the run's
``cluster.json``), each once the previous kill is recovered and training goes on, after a random
0-0.5 s so that the kills fall anywhere in the chief's liveness poll. The run is then stopped
(SIGTERM) and each kill matched with its ``recovery_log`` entry in ``summary.json``: the
detection time is the entry's ``time`` (when the chief saw the loss) minus the moment of the
kill, both read from the machine's clock. The recovery time (``recovered_s``, from the loss seen
to the new tasks started) is reported too.

Figures (median and worst of each kind) go to stdout and ``benchmarks/results/detection.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "detection.json"


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    return max((json.loads(x).get("step", -1) for x in path.read_text().splitlines() if x.strip()), default=-1)


def task_pids(run_dir: Path) -> dict[str, int]:
    try:
        return {k: int(v["pid"]) for k, v in json.loads((run_dir / "cluster.json").read_text())["tasks"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def wait(cond, what: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise SystemExit(f"dtrain run exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def figures(values: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(values), 3), "worst_s": round(max(values), 3),
            "best_s": round(min(values), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="kills of each kind (default 10)")
    ap.add_argument("--seed", default="detection")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kinds = ["ps", "worker"] * args.kills
    with tempfile.TemporaryDirectory(prefix="dtrain-detection-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml", "--run-dir", str(run_dir),
               "--quiet", "--set", "training.steps=100000000", "--set", "checkpoint={every_steps: 50, keep: 2}",
               "--set", "summary.every_steps=10", "--set", "summary.tensorboard=false",
               "--set", f"training.max_recoveries={len(kinds) + 5}", "--set", "eval={}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        kills: list[tuple[str, str, float]] = []  # (kind, task, time of the kill)
        try:
            for i, kind in enumerate(kinds):
                target = max(last_step(run_dir), 0) + 30  # training goes on after the previous recovery
                wait(lambda t=target: last_step(run_dir) >= t, f"step {target}", proc)
                time.sleep(rng.uniform(0, 0.5))
                pids = task_pids(run_dir)
                task = f"/job:{kind}/task:{(i // 2) % 2}"
                kills.append((kind, task, time.time()))
                os.kill(pids[task], signal.SIGKILL)
                wait(lambda t=task, p=pids[task]: task_pids(run_dir).get(t, p) != p, f"{task} restarted", proc)
                print(f"kill {i + 1}/{len(kinds)}: {task}", file=sys.stderr)
            target = max(last_step(run_dir), 0) + 30  # the last recovery done too
            wait(lambda t=target: last_step(run_dir) >= t, f"step {target}", proc)
            os.killpg(proc.pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        summary = json.loads((run_dir / "summary.json").read_text())
    log = summary["recovery_log"]
    if len(log) != len(kills) or any(rec["lost"] != [task] for rec, (_, task, _) in zip(log, kills, strict=False)):
        print(f"the recovery log does not match the kills:\n{json.dumps(log, indent=1)}\n{err[-3000:]}",
              file=sys.stderr)
        return 1
    result: dict[str, object] = {"command": " ".join(cmd[1:]).replace(str(run_dir), "RUN_DIR"), "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    for kind in ("ps", "worker"):
        detected = [rec["time"] - t for rec, (k, _, t) in zip(log, kills, strict=True) if k == kind]
        recovered = [rec["recovered_s"] for rec, (k, _, _) in zip(log, kills, strict=True)
                     if k == kind and "recovered_s" in rec]
        result[kind] = {"kills": len(detected), "detected_s": [round(x, 3) for x in detected], **figures(detected),
                        "recovered": figures(recovered)}
        print(f"{kind:6s}: {len(detected)} kills, detected in median {statistics.median(detected):.3f} s, "
              f"worst {max(detected):.3f} s; recovered in median {statistics.median(recovered):.2f} s, "
              f"worst {max(recovered):.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
