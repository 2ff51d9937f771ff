#!/usr/bin/env python
"""What the ``/dtrain`` page costs the scheduler: its CPU per second with the page open, against without.

Usage (from the repository root; needs Debian's ``chromium``: ``make bench-dashboard`` installs it)::

    python benchmarks/dashboard_cost.py                 # 60 s without the page, then 60 s with it
    python benchmarks/dashboard_cost.py --seconds 30 --replicas 16 --shards 8 --tables 26

A ``dask scheduler`` process (dtrain's plugin registered, as a chief registers it) and one ``dask
worker`` process (the tasks' memory comes from its heartbeats) on 127.0.0.1. This process plays
the chief: a run's telemetry payload every ``--interval`` seconds (``--replicas`` replicas,
``--shards`` ps shards, ``--tables`` sparse tables; the figures move as in a run, so every
payload is a new point and a new feed). Before measuring, payloads spread over a day fill the
run's history to its bound, so the feed is as large as a long run's.

Then, in the scheduler process (``psutil``: user + system CPU seconds over wall seconds):

- ``idle``: the payloads only, no viewer;
- ``page``: the same with the page open in headless Chromium (1280 x 900), which asks for
  ``/dtrain/live.json`` every two seconds.

Reported: each phase's CPU share of one core, the page's (the difference; goal: under 2% of one
core), the time of the first drawing of the page (once per change of its shape), and the feed's
size. Figures go to stdout and ``benchmarks/results/dashboard_cost.json``. The machine's other
load adds noise: run it on a quiet machine, and compare the phases of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def payload(run: str, i: int, t: float, args: argparse.Namespace, worker: str) -> dict:
    """Interval ``i`` of a run at time ``t``: every figure moves a little, as in training."""
    wave = math.sin(i / 7)
    replicas = {str(r): {"task": f"/job:worker/task:{r}", "steps": 40 * i, "steps_per_s": 20 + 2 * wave + r % 3,
                         "compute_s": 1.5 * i, "data_s": 0.1 * i, "ps_s": 0.4 * i, "compute_frac": 0.7,
                         "data_frac": 0.05, "ps_frac": 0.2 + 0.01 * wave, "bytes_sent": 2e6 * i, "bytes_recv": 2e6 * i}
                for r in range(args.replicas)}
    shards = {}
    for s in range(args.shards):
        tables = {f"tables.C{k}.weight": {"live_rows": 1000 * i + k, "bytes": 4e5 * i, "admitted": 1100 * i,
                                          "evicted": 100 * i, "rejected": 5 * i}
                  for k in range(args.tables) if k % args.shards == s}
        shards[str(s)] = {"task": f"/job:ps/task:{s}", "pushes": 300 * i, "applies": 300 * i, "applies_per_s": 150.0,
                          "busy_frac": 0.3 + 0.05 * wave, "bytes_in": 1e7 * i, "bytes_out": 1e7 * i, "dropped": 0,
                          "variables": [f"{s}.weight"], "tables": tables,
                          "staleness": {"le": [0, 1, 2, 4, 8, 16, 32], "counts": [i, 3 * i, 2 * i, i, 0, 0, 0, 0],
                                        "mean": 1.2, "max": 4, "loss": [0.5] * 8}}
    hosts = {f"/job:ps/task:{s}": worker for s in range(args.shards)}
    hosts.update({f"/job:worker/task:{r}": worker for r in range(args.replicas)})
    return {"run": run, "name": "bench", "started": t - i * args.interval - 1, "time": t, "step": 40 * i,
            "steps": 10**9, "loss": 2.0 / (1 + 0.01 * i), "samples_per_s": 5000 + 100 * wave, "replicas": replicas,
            "shards": shards, "hosts": hosts, "diagnosis": [], "checkpoints": [[4000 * k, t - 1000 * k] for k in range(5)],
            "recoveries": [], "eval": {"step": 40 * i - 40 * (i % 50), "loss": 1.5}}


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def measure(proc: psutil.Process, seconds: float, tick: callable) -> float:
    """The process's CPU seconds per wall second over ``seconds``, while ``tick()`` runs every interval."""
    start_cpu, start = cpu(proc), time.monotonic()
    while time.monotonic() - start < seconds:
        tick()
    return (cpu(proc) - start_cpu) / (time.monotonic() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase's length")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between payloads (observe.interval_s)")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dashboard_cost.json")
    args = ap.parse_args()

    from distributed import Client

    from dtrain.deploy.plugin import register
    from dtrain.observe.history import MAX_POINTS
    from dtrain.observe.scheduler import TOPIC, TelemetryPlugin
    from tests.helpers.browser import Page, find_chromium

    binary = find_chromium()
    if binary is None:
        print("no chromium: apt-get install -y chromium (make bench-dashboard does it as root)", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp = Path(tempfile.mkdtemp(prefix="dtrain-dashboard-bench-"))
    sched_file = tmp / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sched_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists():
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.1)
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                                       str(sched_file), "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        scheduler = psutil.Process(procs[0].pid)
        with Client(scheduler_file=str(sched_file), timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            assert register(client, TelemetryPlugin(), "no page"), "the scheduler refused dtrain's plugin"
            worker = next(iter(client.scheduler_info()["workers"]))
            base = client.dashboard_link.rsplit("/", 1)[0]
            run, now = "bench-0badc0de", time.time()
            n = backlog = 4 * MAX_POINTS  # a day's history, thinned to its bound, as a day-long run's
            for i in range(backlog):
                client.log_event(TOPIC, payload(run, i, now - 86400 * (backlog - i) / backlog, args, worker))
            next_at = time.monotonic()

            def tick() -> None:
                nonlocal n, next_at
                client.log_event(TOPIC, payload(run, n, time.time(), args, worker))
                n += 1
                next_at += args.interval
                time.sleep(max(next_at - time.monotonic(), 0))

            time.sleep(2 * args.interval)  # the backlog taken
            idle = measure(scheduler, args.seconds, tick)
            t0 = time.monotonic()
            with urllib.request.urlopen(base + "/dtrain", timeout=120) as r:
                page_bytes = len(r.read())
            draw_s = time.monotonic() - t0
            with urllib.request.urlopen(base + "/dtrain/live.json", timeout=60) as r:
                feed_bytes = len(r.read())
            with Page(binary, width=1280, height=900) as page:
                page.open(base + "/dtrain")
                page.wait_for("window.Bokeh !== undefined && Bokeh.documents.length > 0", 60)
                with_page = measure(scheduler, args.seconds, tick)
                feeds = page.evaluate('performance.getEntriesByType("resource")'
                                      '.filter((e) => e.name.endsWith("/dtrain/live.json")).length')
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    result = {"idle_cpu_share": idle, "page_cpu_share": with_page, "page_cost_share": with_page - idle,
              "first_draw_s": draw_s, "page_bytes": page_bytes, "feed_bytes": feed_bytes, "feeds_served": feeds,
              "seconds": args.seconds, "interval_s": args.interval, "replicas": args.replicas, "shards": args.shards,
              "tables": args.tables, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                 "load_avg": os.getloadavg()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"scheduler CPU, payloads only:     {100 * idle:6.2f}% of one core")
    print(f"scheduler CPU, page open:         {100 * with_page:6.2f}% of one core ({feeds} feeds served)")
    print(f"the page's cost:                  {100 * (with_page - idle):6.2f}% of one core (goal: under 2%)")
    print(f"first drawing of the page:        {draw_s:6.2f} s ({page_bytes / 1024:.0f} KiB; redrawn only when its shape changes)")
    print(f"the feed:                         {feed_bytes / 1024:6.0f} KiB per poll")
    return 0


if __name__ == "__main__":
    sys.exit(main())
