#!/usr/bin/env python
"""What the fixed costs of a run grow like with its replicas, across the network lab: a tiny
model (so that fixed per-step and per-tick costs dominate), 1 ps task and 1, 2, 4, 8 and 16
replicas, async, sync and elastic async (docs/lab.md, "Scaling").

Usage (root; from the repository root)::

    python benchmarks/lab_scaling.py                       # 1, 2, 4, 8, 16 replicas, async, sync, elastic
    python benchmarks/lab_scaling.py --replicas 1,4 --modes async --window 10

Hosts: ``scheduler`` (``dask scheduler``), ``client`` (``dtrain run --scheduler``: the chief),
``ps0`` and ``worker0`` ... ``worker15``: one ``dtrain worker`` per lab host. The cluster grows
with the rows: before the rows of N replicas the workers of tasks worker-0 ... worker-(N-1) are
started (and kept), so a run with N replicas has a cluster of exactly N + 1 Dask workers, as a
deployment sized for it would, and the modes of one N run on the same cluster. Before each
N the idle cluster's CPU is measured too (``--idle`` seconds, no run): the scheduler's and the
workers' baseline at that size (heartbeats).

Each row is one run, stopped cleanly by a hook (``benchmarks/lab/hooks.py``) when its timed
window is over. The window starts ``--settle`` seconds after the run's first summary record
(every replica started and training) and lasts ``--window`` seconds. Over it, from the CPU
times of every process of a host (psutil; user + system) and the run's records:

- ``steps/s``: global steps per second (the ps's step, from metrics.jsonl's records);
- ``ps CPU/push``: ps0's CPU seconds / the pushes it served in the window (async: one per global
  step; sync: one per replica per step; from the ps's own count in summary.json);
- ``chief CPU/s``: the ``dtrain run`` process's CPU seconds per second of wall time;
- ``scheduler CPU/s``: the ``dask scheduler``'s, and ``workers CPU/s`` all the worker hosts'.

Growth columns: each figure over the same mode's 1-replica figure, beside the replica count (a
figure that grows at most linearly stays at or below it). The JSON goes to
``benchmarks/results/lab_scaling.json``; docs/gen_results.py renders the table in docs/lab.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtrain_bench.configs import RESULTS, progress  # noqa: E402
from lab import Lab, probe  # noqa: E402
from lab.cluster import LabCluster, host_names  # noqa: E402

MODEL = {"input_shape": [16], "layers": [{"type": "linear", "out": 16}, {"type": "relu"},
                                         {"type": "linear", "out": 4}], "loss": "cross_entropy"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2,4,8,16", help="comma-separated replica counts")
    ap.add_argument("--modes", default="async,sync,elastic",
                    help="comma-separated: async, sync, elastic (async, cluster.jobs.worker {min: 1, max: N})")
    ap.add_argument("--rate", default="10gbit", help="every link's rate (tc syntax)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--settle", type=float, default=6.0, help="seconds after the first record before the window")
    ap.add_argument("--window", type=float, default=15.0, help="seconds measured")
    ap.add_argument("--every", type=int, default=10, help="summary.every_steps")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of the idle cluster measured first")
    ap.add_argument("--worker-ttl", default="60s",
                    help="the scheduler's worker-ttl (16 replicas on 2 shared cores can starve a heartbeat 10 s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to each row")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a pipeline override for every run")
    ap.add_argument("--out", type=Path, default=RESULTS / "lab_scaling.json", help="JSON results")
    ap.add_argument("--keep", action="store_true", help="keep the logs and run directories")
    return ap.parse_args(argv)


def spec_for(mode: str, replicas: int, batch: int, every: int, stop_file: Path) -> dict[str, Any]:
    """``elastic``: async with ``cluster.jobs.worker: {min: 1, max: N}`` (the chief also polls
    the scheduler's workers for joins and leaves)."""
    workers: int | dict[str, int] = {"min": 1, "max": replicas} if mode == "elastic" else replicas
    return {"name": f"lab-scaling-{mode}-{replicas}",
            "cluster": {"jobs": {"ps": 1, "worker": workers}},
            "model": MODEL,
            "data": {"source": "synthetic", "num_samples": 4096, "num_classes": 4, "batch_size": batch},
            "optimizer": {"name": "sgd", "lr": 0.01},
            "training": {"mode": "async" if mode == "elastic" else mode, "steps": 10_000_000, "seed": 0,
                         "torch_threads": 1},
            "summary": {"every_steps": every, "tensorboard": False},
            "hooks": [{"type": "benchmarks.lab.hooks:StopFileHook", "args": {"path": str(stop_file)}}]}


# ------------------------------------------------------------------------------------ CPU
def host_cpu(lab: Lab, names: list[str]) -> float:
    """CPU seconds (user + system) of every live process on the hosts ``names``."""
    import psutil

    total = 0.0
    for name in names:
        for pid in lab[name].pids():
            try:
                t = psutil.Process(pid).cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += t.user + t.system
    return total


class Meter:
    """CPU seconds of the ps, chief, scheduler and worker hosts at one instant."""

    def __init__(self, lab: Lab, workers: list[str]):
        self.lab, self.workers = lab, workers

    def read(self) -> dict[str, float]:
        return {"time": time.time(), "ps": host_cpu(self.lab, ["ps0"]), "chief": host_cpu(self.lab, ["client"]),
                "scheduler": host_cpu(self.lab, ["scheduler"]), "workers": host_cpu(self.lab, self.workers)}


def last_record(run_dir: Path) -> dict[str, Any] | None:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("step") is not None and "loss" in rec:
            return rec
    return None


# ------------------------------------------------------------------------------------ a row
def run_row(lab: Lab, cluster: LabCluster, meter: Meter, args: argparse.Namespace, workdir: Path, mode: str,
            n: int) -> dict[str, Any]:
    name = f"{mode}_{n}"
    run_dir = workdir / f"run-{name}"
    stop = workdir / f"stop-{name}"
    proc = cluster.run(spec_for(mode, n, args.batch, args.every, stop), run_dir, args.sets, name=f"run-{name}")
    deadline = time.monotonic() + args.timeout
    out: dict[str, Any] = {"name": name, "mode": mode, "replicas": n}
    try:
        while last_record(run_dir) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no training record: {cluster.log(f'run-{name}', 1500)}")
            time.sleep(0.2)
        time.sleep(args.settle)
        rec_a, cpu_a = last_record(run_dir), meter.read()
        time.sleep(args.window)
        rec_b, cpu_b = last_record(run_dir), meter.read()
        stop.touch()
        rc = proc.wait(max(10.0, deadline - time.monotonic()))
    except BaseException as exc:
        stop.touch()
        cluster.stop(f"run-{name}")
        return {**out, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    if rc != 0 or summary.get("status") != "completed":
        return {**out, "status": "failed", "error": f"exit {rc}: {summary.get('error')}"}
    assert rec_a is not None and rec_b is not None
    steps = rec_b["step"] - rec_a["step"]
    wall = cpu_b["time"] - cpu_a["time"]
    shard = (summary.get("shards_stats") or {}).get("0", {})
    run_steps = summary["global_step"] - summary.get("start_step", 0)
    per_step = shard["pushes"] / run_steps if shard.get("pushes") and run_steps else (n if mode == "sync" else 1)
    pushes = steps * per_step
    cpu = {k: cpu_b[k] - cpu_a[k] for k in ("ps", "chief", "scheduler", "workers")}
    return {**out, "status": "ok", "window_s": round(wall, 2), "steps": steps,
            "steps_per_s": steps / max(1e-9, rec_b["time"] - rec_a["time"]),
            "pushes_per_step": per_step, "pushes": pushes,
            "ps_cpu_per_push_ms": 1000 * cpu["ps"] / pushes if pushes else None,
            "ps_cpu_per_s": cpu["ps"] / wall, "chief_cpu_per_s": cpu["chief"] / wall,
            "scheduler_cpu_per_s": cpu["scheduler"] / wall, "workers_cpu_per_s": cpu["workers"] / wall,
            "global_step": summary["global_step"], "stop_reason": summary.get("stop_reason"),
            "shm_conns": (summary.get("data_plane") or {}).get("shared_memory_connections")}


# ------------------------------------------------------------------------------------ report
GROWS = ("ps_cpu_per_push_ms", "chief_cpu_per_s", "scheduler_cpu_per_s")  # (as docs/gen_results.py's)


def add_growth(results: list[dict[str, Any]]) -> None:
    """Each figure of ``GROWS`` over its mode's 1-replica (smallest) row's."""
    for mode in {r["mode"] for r in results}:
        ok = sorted((r for r in results if r["mode"] == mode and r["status"] == "ok"), key=lambda r: r["replicas"])
        if not ok:
            continue
        base = ok[0]
        for r in ok:
            r["growth"] = {k: r[k] / base[k] if base.get(k) else None for k in GROWS}
            r["replica_growth"] = r["replicas"] / base["replicas"]


def table(doc: dict[str, Any]) -> list[str]:
    """The markdown table: docs/gen_results.py's, which renders it into docs/lab.md."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_results", Path(__file__).resolve().parents[1] / "docs"
                                                  / "gen_results.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows: list[str] = gen.lab_scaling_rows(doc)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = probe()
    if why:
        print(f"the network lab cannot be built here: {why}; nothing was measured", file=sys.stderr)
        return 2
    counts = [int(x) for x in args.replicas.split(",")]
    modes = args.modes.split(",")
    most = max(counts)
    tasks = [("ps", 0), *(("worker", i) for i in range(most))]
    workdir = Path(tempfile.mkdtemp(prefix="lab-scaling-"))
    doc: dict[str, Any] = {"settings": {"replicas": counts, "modes": modes, "rate": args.rate, "batch": args.batch,
                                        "settle_s": args.settle, "window_s": args.window, "every": args.every,
                                        "sets": args.sets, "model": MODEL,
                                        "spread": "one dtrain worker per lab host (ps0, worker0 ... "
                                                  f"worker{most - 1}); the cluster has N + 1 workers for N replicas"},
                           "results": []}
    t0 = time.time()
    try:
        with Lab(host_names(tasks), rate=args.rate) as lab:
            cluster = LabCluster(lab, tasks[:1], workdir / "cluster", worker_ttl=args.worker_ttl)
            try:
                cluster.start(timeout=600)
                progress(f"lab and scheduler up: {len(lab.hosts)} hosts ({time.time() - t0:.0f} s)")
                meter = Meter(lab, [f"worker{i}" for i in range(most)])
                doc["idle"] = {}
                for n in counts:
                    for i in range(n):
                        if f"worker-{i}" not in cluster.procs:
                            cluster.start_worker("worker", i)
                    cluster.wait_for({"ps-0", *(f"worker-{i}" for i in range(n))}, timeout=600)
                    time.sleep(2)
                    a = meter.read()
                    time.sleep(args.idle)
                    b = meter.read()
                    idle = {k: (b[k] - a[k]) / (b["time"] - a["time"]) for k in ("ps", "scheduler", "workers")}
                    doc["idle"][str(n)] = idle
                    progress(f"idle cluster of {n + 1} workers: scheduler {idle['scheduler']:.3f} CPU/s, workers "
                             f"{idle['workers']:.3f} CPU/s")
                    for mode in modes:
                        t = time.time()
                        res = run_row(lab, cluster, meter, args, workdir, mode, n)
                        res["elapsed_s"] = round(time.time() - t, 1)
                        res["idle_scheduler_cpu_per_s"] = idle["scheduler"]
                        doc["results"].append(res)
                        progress(f"{mode} {n} replicas: " + (
                            f"{res['steps_per_s']:.1f} steps/s, ps {res['ps_cpu_per_push_ms']:.2f} ms/push, chief "
                            f"{res['chief_cpu_per_s']:.3f} CPU/s, scheduler {res['scheduler_cpu_per_s']:.3f} CPU/s"
                            if res["status"] == "ok" else f"FAILED {res['error']}") + f" ({res['elapsed_s']:.0f} s)")
            finally:
                cluster.close()
        doc["leftovers"] = lab.leftovers()
    finally:
        doc["elapsed_s"] = round(time.time() - t0, 1)
        add_growth(doc["results"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print("\n".join(table(doc)))
        print(f"\nresults: {args.out}; {doc['elapsed_s']:.0f} s")
        if args.keep:
            print(f"logs and run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r["status"] != "ok" for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
