#!/usr/bin/env python
"""Model parallelism: a 2-stage pipeline (GPipe) of a compute-heavy MLP against plain PyTorch, in one run.

Usage (from the repository root)::

    python benchmarks/pipeline_bench.py                 # 3 interleaved repetitions, 1/4/8 micro-batches
    python benchmarks/pipeline_bench.py --quick         # a small model, 1 repetition (what the test runs)

What is measured
----------------
The model: an MLP of ``--width``-wide layers (default 3072 -> 2048 x 4 -> 10, 18.9 M parameters: the
first layer wider so that both stages do the same work, the first having no input gradient),
batch ``--batch`` (2048), SGD lr 0.01, synthetic data in memory, one torch thread per process.

- ``plain``: a plain PyTorch loop in its own subprocess (``torch.set_num_threads(1)``),
  ``--warmup`` steps then ``--steps`` timed steps.
- ``pipeline_mN``: ``dtrain.run`` on an embedded cluster (1 ps, 2 worker tasks: the first two
  linear layers on worker task 0, the rest on worker task 1), ``training.microbatches: N``, every
  other key at its default (async, socket data plane with shared memory). Steady-state samples/s
  from ``metrics.jsonl`` (records every 5 steps, after ``--warmup`` steps), as benchmarks/bench.py.

Per pipeline row: the ratio to ``plain`` of the same repetition (medians over repetitions), the
activation bytes per micro-batch (stage 0's output) and the link's cost: the sender's time per
message (serialising and writing it to the socket) and stage 0's wait per gradient received (which
also holds the bubble: the time stage 1 computes). GPipe's bound on 2 cores: ``2 M / (M + 1)``
(1.0x, 1.6x, 1.78x for M = 1, 4, 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def spec_yaml(a: argparse.Namespace, microbatches: int, run_steps: int) -> str:
    w = a.width
    return f"""
name: pipeline-bench
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  input_shape: [{a.features}]
  layers:
    - {{type: linear, out: {w}, device: /job:worker/task:0}}
    - {{type: relu, device: /job:worker/task:0}}
    - {{type: linear, out: {w}, device: /job:worker/task:0}}
    - {{type: relu, device: /job:worker/task:0}}
    - {{type: linear, out: {w}, device: /job:worker/task:1}}
    - {{type: relu, device: /job:worker/task:1}}
    - {{type: linear, out: {w}, device: /job:worker/task:1}}
    - {{type: relu, device: /job:worker/task:1}}
    - {{type: linear, out: 10, device: /job:worker/task:1}}
  loss: cross_entropy
data: {{source: synthetic, num_samples: {max(1024, a.batch * 4)}, num_classes: 10, batch_size: {a.batch}, test_fraction: 0.05}}
optimizer: {{name: sgd, lr: 0.01}}
training: {{steps: {run_steps}, microbatches: {microbatches}}}
summary: {{every_steps: 5, tensorboard: false}}
eval: {{}}
"""


# ------------------------------------------------------------------------------------ children


def child_plain(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(a.features, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(a.batch * 4, a.features), torch.randint(0, 10, (a.batch * 4,))
    t0 = 0.0
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            t0 = time.perf_counter()
        j = (i % 4) * a.batch
        opt.zero_grad()
        loss_fn(model(x[j:j + a.batch]), y[j:j + a.batch]).backward()
        opt.step()
    return {"samples_per_sec": a.steps * a.batch / (time.perf_counter() - t0)}


def child_pipeline(a: argparse.Namespace) -> dict[str, Any]:
    import dtrain

    steps = a.warmup + a.steps
    spec = dtrain.loads(spec_yaml(a, a.microbatches, steps), base_dir=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="dtrain-pipeline-bench-") as d:
        result = dtrain.run(spec, run_dir=Path(d) / "run")
        records = [json.loads(x) for x in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in records if "loss" in r and r["step"] >= a.warmup]
    if len(timed) >= 2:
        first, last = timed[0], timed[-1]
        rate = (last["step"] - first["step"]) * a.batch / (last["time"] - first["time"])
        method = "metrics.jsonl"
    else:
        rate, method = result.summary["samples_per_sec"], "summary"
    stats0 = result.replica_stats[0]
    stage1 = stats0["extra"]["stages"][0]
    link0, link1 = stats0["extra"]["stage"], stage1["extra"]["stage"]
    microbatch_steps = max(1, steps * a.microbatches)
    return {"samples_per_sec": rate, "method": method, "run_status": result.summary["status"],
            "activation_bytes": result.plan.stages[0].activation_bytes,
            "link_bytes_per_step": (link0["bytes_sent"] + link0["bytes_received"]) / max(1, steps),
            "shared_bytes_per_step": (link0["bytes_shared"] + link1["bytes_shared"]) / max(1, steps),
            "shared_memory": int(link0["shared_memory"]),
            "send_ms_per_message": 1e3 * (link0["send_s"] + link1["send_s"]) / (2 * microbatch_steps),
            "wait_ms_per_gradient": 1e3 * link0["exchange_s"] / microbatch_steps}


# ------------------------------------------------------------------------------------ driver


def run_child(kind: str, a: argparse.Namespace, microbatches: int = 1) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--microbatches", str(microbatches), "--width", str(a.width),
           "--features", str(a.features),
           "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"status": "failed", "error": proc.stderr[-2000:]}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--features", type=int, default=3072)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--microbatches", default="1,4,8")
    p.add_argument("--quick", action="store_true", help="width 256, batch 64, 10 steps, 1 repetition, M = 1 and 4")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    p.add_argument("--child", choices=["plain", "pipeline"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        a.microbatches = int(a.microbatches)
        out = child_plain(a) if a.child == "plain" else child_pipeline(a)
        print(json.dumps(out))
        return 0
    if a.quick:
        a.reps, a.width, a.features, a.batch, a.steps, a.warmup, a.microbatches = 1, 256, 384, 64, 10, 5, "1,4"
    ms = [int(m) for m in a.microbatches.split(",")]
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], **{f"pipeline_m{m}": [] for m in ms}}
    for rep in range(a.reps):
        plain = run_child("plain", a)
        rows["plain"].append({**plain, "ratio": 1.0})
        for m in ms:
            r = run_child("pipeline", a, m)
            if r["status"] == "ok" and plain["status"] == "ok":
                r["ratio"] = r["samples_per_sec"] / plain["samples_per_sec"]
            rows[f"pipeline_m{m}"].append(r)
            print(f"rep {rep + 1}: pipeline_m{m} {r.get('samples_per_sec', 0):.0f} samples/s "
                  f"({r.get('ratio', 0):.2f}x plain {plain.get('samples_per_sec', 0):.0f})", flush=True)
    results = {}
    for name, reps in rows.items():
        ok = [r for r in reps if r["status"] == "ok"]
        if not ok:
            results[name] = {"status": "failed", "error": reps[-1].get("error")}
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))}
        ratios = [r["ratio"] for r in ok if "ratio" in r]
        results[name] = {"status": "ok", **med, "ratio_range": [min(ratios), max(ratios)] if ratios else None}
    print(f"\n{'config':<14} {'samples/s':>10} {'x plain':>8} {'range':>12} {'act B/mb':>9} {'send ms':>8} {'wait ms':>8}")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:<14} failed: {str(r.get('error'))[-300:]}")
            continue
        rng = f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}" if r.get("ratio_range") else ""
        print(f"{name:<14} {r['samples_per_sec']:>10.0f} {r['ratio']:>8.2f} {rng:>12} "
              f"{r.get('activation_bytes', 0):>9.0f} {r.get('send_ms_per_message', 0):>8.3f} "
              f"{r.get('wait_ms_per_gradient', 0):>8.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"settings": {k: v for k, v in vars(a).items() if k != "child"},
                                       "results": results}, indent=2))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
