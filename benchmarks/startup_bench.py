#!/usr/bin/env python
"""Start-up and shut-down: a small job's whole time, dtrain against a plain PyTorch script (issue 19).

Usage (from the repository root)::

    python benchmarks/startup_bench.py            # median of 3 interleaved repetitions
    python benchmarks/startup_bench.py --reps 5 --steps 300

Each repetition runs, one after the other in fresh processes:

- ``plain``: a plain PyTorch script that imports torch and scikit-learn, loads the digits, trains
  the digits pipeline's MLP (64-128-10, SGD lr 0.05, batch 32) for ``--steps`` steps, evaluates on
  the held-out fifth and saves the state dict: timed from the process's spawn to its exit;
- ``dtrain``: ``dtrain run pipelines/digits_async.yaml --set training.steps=N --quiet
  --profile-startup`` (2 ps and 2 worker processes on the embedded cluster), timed the same way;
  its phase table (``dtrain.deploy.phases``) gives when the first step came and when the last one
  ended, both from the process's start;
- ``dtrain_spawn``: the same with ``--set cluster.start_method=spawn`` (worker processes spawned
  fresh, as before the forkserver), to show what the warm parent saves.

Reported (medians; ratios within each repetition): the whole time of each and their ratio (the
issue's goal: at most 1.5x), the first step's time against the plain script's whole run (goal: at
most 1.0x), the time from the last step to the process's exit (goal: under 1 s), and each phase's
median. Figures go to stdout and ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLAIN = r"""
import sys, torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
steps, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
x_tr, y_tr = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(y_tr)
x_te, y_te = torch.tensor(x_te, dtype=torch.float32), torch.tensor(y_te)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(steps):
    idx = torch.randint(0, len(x_tr), (32,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
    opt.step()
with torch.no_grad():
    acc = (model(x_te).argmax(1) == y_te).float().mean().item()
torch.save(model.state_dict(), out)
print(f"accuracy {acc:.4f}")
"""

ROW = re.compile(r"(.+?)\s+(\d+\.\d\d)\s+(\d+\.\d\d)")


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return time.time() - t0, out


def plain(steps: int, tmp: Path) -> float:
    wall, out = timed([sys.executable, "-c", PLAIN, str(steps), str(tmp / "plain.pt")])
    if out.returncode != 0:
        raise SystemExit(f"the plain script failed:\n{out.stderr[-2000:]}")
    return wall


def dtrain(steps: int, tmp: Path, rep: int, *extra: str) -> tuple[float, dict[str, float]]:
    wall, out = timed([sys.executable, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml",
                       "--set", f"training.steps={steps}", "--run-dir", str(tmp / f"run{rep}{len(extra)}"), "--quiet",
                       "--profile-startup", *extra])
    if out.returncode != 0:
        raise SystemExit(f"dtrain run failed:\n{out.stderr[-2000:]}")
    table = out.stderr[out.stderr.index("phase "):].splitlines()[1:]
    phases: dict[str, float] = {}
    for line in table:
        m = ROW.fullmatch(line.strip())
        if m:
            phases[m.group(1)] = float(m.group(3))  # its end, since the process's start
    return wall, phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    args = ap.parse_args()
    reps = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(args.reps):
            p = plain(args.steps, tmp)
            w, phases = dtrain(args.steps, tmp, rep)
            ws, spawn_phases = dtrain(args.steps, tmp, rep, "--set", "cluster.start_method=spawn")
            first = next(v for k, v in phases.items() if k.startswith("first step"))
            last = next(v for k, v in phases.items() if k.startswith("training"))
            reps.append({"plain_s": p, "dtrain_s": w, "ratio": w / p, "first_step_s": first,
                         "first_step_ratio": first / p, "after_last_step_s": w - last,
                         "spawn_s": ws, "spawn_ratio": ws / p, "phases": phases, "spawn_phases": spawn_phases})
            print(f"rep {rep + 1}: plain {p:.2f} s, dtrain {w:.2f} s ({w / p:.2f}x), first step at {first:.2f} s, "
                  f"{w - last:.2f} s from the last step to the exit", file=sys.stderr)
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if not k.endswith("phases")}
    print(f"{'':<34} {'median':>8}  (range)")
    for key, label, unit in [("plain_s", "plain PyTorch script", "s"), ("dtrain_s", "dtrain run", "s"),
                             ("ratio", "dtrain / plain", "x"), ("first_step_s", "dtrain's first step at", "s"),
                             ("first_step_ratio", "first step / plain's whole run", "x"),
                             ("after_last_step_s", "last step to exit", "s"),
                             ("spawn_s", "dtrain run, start_method spawn", "s"),
                             ("spawn_ratio", "spawn / plain", "x")]:
        vals = [r[key] for r in reps]
        print(f"{label:<34} {med[key]:>7.2f}{unit}  ({min(vals):.2f}-{max(vals):.2f})")
    print(f"\ndtrain's phases (median seconds each took): {'forkserver':>10} {'spawn':>7}")
    names = list(reps[0]["phases"])
    ends = {key: {n: statistics.median(r[key].get(n, 0.0) for r in reps) for n in names}
            for key in ("phases", "spawn_phases")}
    last = {"phases": 0.0, "spawn_phases": 0.0}
    for n in names:
        took = {k: ends[k][n] - last[k] for k in last}
        print(f"  {n:<54} {took['phases']:>6.2f} {took['spawn_phases']:>7.2f}")
        last = {k: ends[k][n] for k in last}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "reps": reps, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
