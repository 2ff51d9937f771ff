"""Sparse embedding tables (``bench.py --sparse``): a click-through model whose embedding table
has 10^4, 10^6 and 10^7 rows (dim 32), trained by dtrain (sync, 2 ps tasks holding the table's
rows, 2 workers), by a plain PyTorch loop (one process, ``nn.Embedding(sparse=True)``) and by
torch DDP (gloo, 2 processes, the same sparse embedding), in the same run.

The model: 8 categorical fields -> embedding (rows x 32) -> flatten -> linear 64 -> relu ->
linear 1, BCE with logits, Adagrad lr 0.05 (TensorFlow's usual optimizer for embeddings; torch's
Adagrad on the sparse table's gradient). Data: ``dtrain.data.ctr`` (Zipf-distributed ids over the
table's rows), 20,000 examples, written once per size to an ``.npz`` file all three read.

Per size and system: samples/s, step time, bytes moved per step (the loopback counter, machine-wide,
median over the timed window's intervals), the replicas' and each ps's peak RSS, and for dtrain
each ps's state (its rows and their Adagrad accumulators, plus the dense shards and their state).
The goals (issue 13) are printed with the figures: the 10^7-row table within 1.25x the step time
of the 10^4-row table; a replica's peak RSS growing by less than 100 MB from 10^4 to 10^7 rows;
each ps's peak RSS under 1.5x its state (above its idle RSS); ahead of DDP at 10^7 rows.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .configs import progress
from .machine import LoopbackSampler

SIZES = (10_000, 1_000_000, 10_000_000)
DIM, FIELDS, HIDDEN, SAMPLES = 32, 8, 64, 20_000
OPTIMIZER = {"name": "adagrad", "lr": 0.05}


# ------------------------------------------------------------------------------------ children
def _model(rows: int):
    import torch

    return torch.nn.Sequential(torch.nn.Embedding(rows, DIM, sparse=True), torch.nn.Flatten(),
                               torch.nn.Linear(FIELDS * DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


class _Loop:
    """The plain step on a sparse embedding: batches of ids drawn from the data file in a seeded
    order, zero_grad, forward, BCE, backward (a sparse gradient for the table), Adagrad step."""

    def __init__(self, p: dict[str, Any], rank: int, model: Any = None):
        import numpy as np
        import torch

        torch.set_num_threads(p["threads"])
        torch.manual_seed(0)
        self.torch = torch
        data = np.load(p["data"])
        self.x = torch.from_numpy(data["x"].astype(np.int64))
        self.y = torch.from_numpy(data["y"].astype(np.float32))
        self.model = model if model is not None else _model(p["rows"])
        self.opt = torch.optim.Adagrad(self.model.parameters(), lr=OPTIMIZER["lr"])
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.gen = torch.Generator().manual_seed(rank)
        self.b = p["batch"]

    def step(self) -> Any:
        idx = self.torch.randint(0, len(self.x), (self.b,), generator=self.gen)
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(self.x[idx]).reshape(-1), self.y[idx])
        loss.backward()
        self.opt.step()
        return loss


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_sparse_plain(p: dict[str, Any]) -> dict[str, Any]:
    t = _Loop(p, 0)
    for _ in range(p["warmup"]):
        t.step()
    t0 = time.perf_counter()
    for _ in range(p["steps"]):
        loss = t.step()
    dt = time.perf_counter() - t0
    float(loss.detach())
    return {"status": "ok", "samples_per_sec": p["steps"] * t.b / dt, "step_ms": 1e3 * dt / p["steps"],
            "seconds": dt, "peak_rss": _peak_rss()}


def _sparse_trainer(p: dict[str, Any], rank: int, ddp: Any) -> _Loop:
    import torch

    torch.manual_seed(0)
    return _Loop(p, rank, model=ddp(_model(p["rows"])))


def child_sparse_ddp(p: dict[str, Any]) -> dict[str, Any]:
    from .children import spawn_ddp

    world = 2
    sampler = LoopbackSampler()
    sampler.start()
    try:
        ranks = spawn_ddp(p, world, _sparse_trainer)
    finally:
        sampler.stop()
    dt = max(r["seconds"] for r in ranks)
    out = {"status": "ok", "samples_per_sec": world * p["steps"] * p["batch"] / dt, "step_ms": 1e3 * dt / p["steps"],
           "seconds": dt, "peak_rss": [r["peak_rss"] for r in ranks]}
    a, b = sampler.at(ranks[0]["t_a"]), sampler.at(ranks[0]["t_b"])
    if a is not None and b is not None:
        out["lo_bytes_per_step"] = (b - a) / p["steps"]
    return out


# ------------------------------------------------------------------------------------ the parent
def spec_dict(rows: int, data: str, p: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": f"bench-sparse-{rows}",
        "cluster": {"jobs": {"ps": 2, "worker": 2}},
        "model": {"input_shape": [FIELDS], "loss": "bce_with_logits", "layers": [
            {"type": "embedding", "num_embeddings": rows, "dim": DIM}, {"type": "flatten"},
            {"type": "linear", "out": HIDDEN}, {"type": "relu"}, {"type": "linear", "out": 1}]},
        "data": {"source": data, "batch_size": p["batch"], "test_fraction": 0.1},
        "optimizer": OPTIMIZER,
        "training": {"mode": "sync", "steps": p["warmup"] + p["steps"], "torch_threads": p["threads"], "seed": 0},
        "summary": {"every_steps": p["every"], "tensorboard": False},
    }


def write_data(rows: int, path: Path) -> None:
    import numpy as np

    from dtrain.data.ctr import make_ctr

    x, y = make_ctr(SAMPLES, FIELDS, rows, seed=0)
    np.savez(path, x=x.astype(np.int32), y=y)


def run_sparse(runner: Any, args: Any) -> dict[str, Any]:
    """Every size: plain, DDP and dtrain, one after the other (``--reps`` repetitions)."""
    warmup, steps, every = args.sparse_warmup, args.sparse_steps, args.sparse_every
    out: dict[str, Any] = {"settings": {"sizes": list(SIZES), "dim": DIM, "fields": FIELDS, "hidden": HIDDEN,
                                        "samples": SAMPLES, "optimizer": OPTIMIZER, "batch": args.batch,
                                        "warmup": warmup, "steps": steps, "reps": args.reps},
                           "points": []}
    for rows in args.sparse_rows:
        data = runner.workdir / f"ctr-{rows}.npz"
        write_data(rows, data)
        base = {"rows": rows, "data": str(data), "batch": args.batch, "threads": args.threads, "warmup": warmup,
                "steps": steps}
        for rep in range(args.reps):
            point: dict[str, Any] = {"rows": rows, "rep": rep}
            point["plain"] = runner.child("sparse_plain", {**base, "name": f"plain-{rows}"})
            point["ddp"] = runner.child("sparse_ddp", {**base, "name": f"ddp-{rows}"})
            run_dir = runner.workdir / f"run-sparse-{rows}-{rep}"
            point["dtrain"] = runner.child("dtrain", {
                **base, "name": f"sparse-{rows}", "spec": spec_dict(rows, str(data), {**base, "every": every}),
                "optimizer": OPTIMIZER, "warmup": warmup, "steps": steps, "run_dir": str(run_dir),
                "overrides": args.set or None})
            for system in ("plain", "ddp", "dtrain"):
                r = point[system]
                progress(f"[sparse {rows:,} rows, rep {rep + 1}] {system}: "
                         + (f"{r['samples_per_sec']:,.0f} samples/s" if r.get("status") == "ok"
                            else f"FAILED: {r.get('error')}"))
            out["points"].append(point)
    return out


def _med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_sparse(sp: dict[str, Any]) -> list[dict[str, Any]]:
    rows_out = []
    for rows in sorted({pt["rows"] for pt in sp["points"]}):
        pts = [pt for pt in sp["points"] if pt["rows"] == rows]

        def ok(system: str, pts: list[dict[str, Any]] = pts) -> list[dict[str, Any]]:
            return [pt[system] for pt in pts if pt[system].get("status") == "ok"]

        d = ok("dtrain")
        mem = [r.get("memory") or {} for r in d]
        ps = {n for m in mem for n in m if n.startswith("ps-")}
        workers = {n for m in mem for n in m if n.startswith("worker-")}
        state = d[0]["ps_state_bytes"] if d else []
        row = {
            "rows": rows,
            "plain_sps": _med([r["samples_per_sec"] for r in ok("plain")]),
            "ddp_sps": _med([r["samples_per_sec"] for r in ok("ddp")]),
            "dtrain_sps": _med([r["samples_per_sec"] for r in d]),
            "dtrain_step_ms": _med([r.get("step_ms") for r in d]),
            "dtrain_lo_bytes_per_step": _med([r.get("lo_bytes_per_step") for r in d]),
            "ddp_lo_bytes_per_step": _med([r.get("lo_bytes_per_step") for r in ok("ddp")]),
            "plain_peak_rss": _med([r["peak_rss"] for r in ok("plain")]),
            "ddp_peak_rss": _med([max(r["peak_rss"]) for r in ok("ddp")]),
            "replica_peak_rss": _med([max(m[n]["peak_rss"] for n in workers if n in m) for m in mem if workers]),
            "ps": [{"name": n, "peak_rss": _med([m[n]["peak_rss"] for m in mem if n in m]),
                    "idle_rss": _med([m[n]["idle_rss"] for m in mem if n in m]),
                    "state_bytes": state[int(n.split("-")[1])] if state else None} for n in sorted(ps)],
            "failed": [s for s in ("plain", "ddp", "dtrain") if not ok(s)],
        }
        rows_out.append(row)
    return rows_out


def print_sparse(table: list[dict[str, Any]]) -> list[str]:
    """The table and the goals; returns the goals that failed."""
    def f(x: float | None, spec: str = ",.0f") -> str:
        return "–" if x is None else format(x, spec)

    def mb(x: float | None) -> str:
        return "–" if x is None else f"{x / 2**20:,.0f} MB"

    print("\nSparse embedding table (dim 32, 8 fields, batch 128 per replica, Adagrad), 2 replicas:")
    print(f"{'rows':>12} {'plain/s':>9} {'DDP/s':>9} {'dtrain/s':>9} {'step ms':>8} {'dtrain B/step':>14} "
          f"{'DDP B/step':>12} {'replica RSS':>12} {'DDP RSS':>10} {'ps (peak-idle)/state':>22}")
    for r in table:
        ps = ", ".join(f"{(p['peak_rss'] - p['idle_rss']) / p['state_bytes']:.2f}"
                       if p["peak_rss"] and p["idle_rss"] and p["state_bytes"] else "–" for p in r["ps"])
        print(f"{r['rows']:>12,} {f(r['plain_sps']):>9} {f(r['ddp_sps']):>9} {f(r['dtrain_sps']):>9} "
              f"{f(r['dtrain_step_ms'], '.1f'):>8} {f(r['dtrain_lo_bytes_per_step']):>14} "
              f"{f(r['ddp_lo_bytes_per_step']):>12} {mb(r['replica_peak_rss']):>12} {mb(r['ddp_peak_rss']):>10} "
              f"{ps:>22}")
    failed: list[str] = []
    by = {r["rows"]: r for r in table}
    small, large = by.get(min(by)) if by else None, by.get(max(by)) if by else None
    goals = []
    if small and large and small is not large:
        if small["dtrain_step_ms"] and large["dtrain_step_ms"]:
            ratio = large["dtrain_step_ms"] / small["dtrain_step_ms"]
            goals.append((f"step time {large['rows']:,} rows / {small['rows']:,} rows = {ratio:.2f} (goal <= 1.25)",
                          ratio <= 1.25))
        if small["replica_peak_rss"] and large["replica_peak_rss"]:
            grow = (large["replica_peak_rss"] - small["replica_peak_rss"]) / 2**20
            goals.append((f"replica peak RSS growth {grow:,.0f} MB (goal < 100 MB)", grow < 100))
    if large:
        for p in large["ps"]:
            if p["peak_rss"] and p["idle_rss"] and p["state_bytes"]:
                x = (p["peak_rss"] - p["idle_rss"]) / p["state_bytes"]
                goals.append((f"{p['name']} at {large['rows']:,} rows: (peak - idle) RSS / state = {x:.2f} "
                              "(goal < 1.5)", x < 1.5))
        if large["dtrain_sps"] and large["ddp_sps"]:
            goals.append((f"dtrain / DDP at {large['rows']:,} rows = {large['dtrain_sps'] / large['ddp_sps']:.2f} "
                          "(goal > 1)", large["dtrain_sps"] > large["ddp_sps"]))
    for text, met in goals:
        print(f"  {'met ' if met else 'MISSED'}  {text}")
        if not met:
            failed.append(text)
    return failed
