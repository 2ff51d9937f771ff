#!/usr/bin/env python
"""dtrain across the network lab: every row on separate lab hosts with their own full-duplex
links, beside plain PyTorch and torch DDP, at each link rate, in one run (docs/lab.md).

Usage (root; from the repository root)::

    python benchmarks/lab_bench.py                           # 10gbit and 1gbit, every row, 1 repetition
    python benchmarks/lab_bench.py --rates 1gbit --reps 3
    python benchmarks/lab_bench.py --only async_1ps_2w,sync_1ps_2w_bf16   # plain always runs
    python benchmarks/lab_bench.py --tls                     # the dtrain rows on a TLS cluster

Hosts: ``scheduler`` (``dask scheduler``), ``client`` (``dtrain run --scheduler``; the plain loop),
``ps0``, ``ps1``, ``worker0``, ``worker1`` (one ``dtrain worker`` each; DDP's two ranks run on
``worker0`` and ``worker1``). One lab for the whole run; between rates only the links' shapers
change. Rows, at every rate:

- ``plain``: the plain PyTorch loop of bench.py, one process, one thread.
- ``ddp_gloo_2`` (``_bf16``): torch DDP, gloo, rank 0 on worker0 and rank 1 on worker1,
  rendezvous at worker0's address; ``_bf16`` with DDP's ``bf16_compress_hook``.
- ``async_1ps_2w``, ``sync_1ps_2w``, ``async_2ps_2w`` (``_bf16``): ``dtrain run --scheduler`` with
  default settings (no tuning key; the YAML of bench.py), ``_bf16`` with ``training.wire_dtype:
  bfloat16``. The data plane is left at its defaults (``shared_memory: true``): the lab's private
  /dev/shm per host makes it use the sockets, which ``shm`` (the summary's shared-memory
  connections) shows as 0.

samples/s: as bench.py (dtrain from metrics.jsonl after the warm-up; DDP between barriers).
ratio: to the plain loop of the same rate and repetition, which runs first and again last (the
mean of the two: the load of a shared machine drifts). Link figures, from the counters of
every host's link sampled every 50 ms over the row's timed window: the busiest direction of any
link (e.g. ``ps0 in``: gradients into the ps), its bytes per trained sample and its share of the
link's measured rate; ``link ceiling`` = the link's measured rate / those bytes per sample /
plain samples/s: the ratio the links alone allow at that row's bytes per sample, each direction
of each link at the full rate (full duplex). The link's rate is measured in the same run by a raw
TCP transfer worker0 -> ps0 (and both directions at once, to show full duplex).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtrain_bench.configs import ENTRY, MODELS, RESULTS, param_count, progress  # noqa: E402
from lab import Lab, probe  # noqa: E402
from lab.cluster import LabCluster, env, host_names  # noqa: E402
from lab.traffic import LinkSampler, blast, summarize_traffic  # noqa: E402

TASKS = [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
SCALE_WORKERS = (1, 2, 3, 4)
SCALE_PS = (1, 2)
# (name, label, mode, ps tasks, overrides)
DTRAIN_ROWS = [
    ("async_1ps_2w", "dtrain async 1 ps + 2 workers", "async", 1, ()),
    ("sync_1ps_2w", "dtrain sync 1 ps + 2 workers", "sync", 1, ()),
    ("async_2ps_2w", "dtrain async 2 ps + 2 workers", "async", 2, ()),
]
BF16 = ("training.wire_dtype=bfloat16",)


def rows() -> list[dict[str, Any]]:
    out = [{"name": "plain", "label": "plain PyTorch, 1 process", "kind": "plain"},
           {"name": "ddp_gloo_2", "label": "torch DDP gloo, 2 hosts", "kind": "ddp", "bf16": False},
           {"name": "ddp_gloo_2_bf16", "label": "torch DDP gloo, 2 hosts, bf16 hook", "kind": "ddp", "bf16": True}]
    for name, label, mode, ps, sets in DTRAIN_ROWS:
        out.append({"name": name, "label": label, "kind": "dtrain", "mode": mode, "ps": ps, "sets": sets})
        out.append({"name": f"{name}_bf16", "label": f"{label}, bf16 wire", "kind": "dtrain", "mode": mode, "ps": ps,
                    "sets": (*sets, *BF16)})
    return out


def scaling_rows() -> list[dict[str, Any]]:
    """``--scaling``: async and sync, 1 and 2 ps tasks, 1 to 4 workers. With 2 ps tasks the
    variables are ``partitioned`` (bytes balanced over the ps tasks; the default round_robin puts
    every weight matrix of this MLP on ps 0 and every bias on ps 1, so a second ps would carry
    almost nothing)."""
    out = []
    for mode in ("async", "sync"):
        for ps in SCALE_PS:
            for w in SCALE_WORKERS:
                sets = ("placement.variables=partitioned",) if ps > 1 else ()
                out.append({"name": f"scale_{mode}_{ps}ps_{w}w", "label": f"dtrain {mode} {ps} ps + {w} workers",
                            "kind": "dtrain", "mode": mode, "ps": ps, "workers": w, "sets": sets, "scaling": True})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="10gbit,1gbit", help="comma-separated link rates (tc syntax)")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of every row at every rate")
    ap.add_argument("--warmup", type=int, default=50, help="dtrain warm-up global steps")
    ap.add_argument("--steps", type=int, default=300, help="timed steps (dtrain global steps; plain/DDP steps)")
    ap.add_argument("--every", type=int, default=25, help="dtrain summary.every_steps")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--only", default=None, help="comma-separated row names (plain always runs)")
    ap.add_argument("--tls", action="store_true", help="the dtrain rows on a TLS cluster")
    ap.add_argument("--scaling", action="store_true",
                    help="also throughput vs workers (1-4) and ps tasks (1, 2), async and sync (8 lab hosts)")
    ap.add_argument("--scaling-only", action="store_true", help="only the scaling rows (and plain)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to each row")
    ap.add_argument("--out", type=Path, default=RESULTS / "lab.json", help="JSON results (and .md beside it)")
    ap.add_argument("--keep", action="store_true", help="keep the logs and run directories")
    ap.add_argument("--ddp-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup % args.every or args.steps % args.every:
        ap.error(f"--warmup and --steps must be multiples of --every ({args.every})")
    return args


# ------------------------------------------------------------------------------------ rows
def params(args: argparse.Namespace, name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "model": MODELS["w1"], "batch": args.batch, "threads": 1, "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.01}, "num_samples": 8192, "warmup": args.warmup,
            "steps": args.steps, "min_seconds": 3.0, "every": args.every, "replication": "between_graph",
            "placement": "round_robin", "workers": 2, "ps": 1, "mode": "async", **kw}


def run_plain(lab: Lab, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    result = workdir / f"plain-{time.time_ns()}.json"
    p = params(args, "plain", warmup=50)
    proc = lab["client"].run([sys.executable, str(ENTRY), "--child", "plain", "--params", json.dumps(p),
                              "--result", str(result)], check=False, timeout=args.timeout, env=env())
    if proc.returncode != 0 or not result.exists():
        return {"status": "failed", "error": proc.stderr[-500:]}
    return json.loads(result.read_text())


def _bf16_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """DDP's bf16_compress_hook for gloo: the bucket narrowed to bfloat16, averaged, widened back."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def widen(f: Any) -> Any:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(widen)


def ddp_rank(args: argparse.Namespace) -> int:
    """One DDP rank on its lab host (``--ddp-rank R``): rendezvous at MASTER_ADDR, gloo over eth0."""
    import torch
    import torch.distributed as dist
    from dtrain_bench.children import _mlp_trainer
    from torch.nn.parallel import DistributedDataParallel

    p = json.loads(args.params)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.ddp_rank, world_size=p["world"])
    try:
        def wrap(model: Any) -> Any:
            ddp = DistributedDataParallel(model)
            if p["bf16"]:  # torch's bf16_compress_hook refuses gloo (it wants NCCL): the same, by hand
                ddp.register_comm_hook(None, _bf16_hook)
            return ddp

        t = _mlp_trainer(p, args.ddp_rank, wrap)
        for _ in range(50):
            t.step()
        dist.barrier()
        t0, wall0 = time.perf_counter(), time.time()
        for _ in range(p["steps"]):
            loss = t.step()
        float(loss.detach())
        dist.barrier()
        dt = time.perf_counter() - t0
        Path(args.result).write_text(json.dumps({"seconds": dt, "t_a": wall0, "t_b": wall0 + dt}))
    finally:
        dist.destroy_process_group()
    return 0


def run_ddp(lab: Lab, args: argparse.Namespace, workdir: Path, bf16: bool) -> dict[str, Any]:
    p = params(args, "ddp", world=2, bf16=bf16)
    master = lab["worker0"]
    procs, results = [], []
    for rank, host in enumerate(("worker0", "worker1")):
        results.append(workdir / f"ddp-{time.time_ns()}-{rank}.json")
        log = open(workdir / f"ddp-rank{rank}.log", "wb")
        procs.append(lab[host].popen(
            [sys.executable, str(Path(__file__).resolve()), "--ddp-rank", str(rank), "--params", json.dumps(p),
             "--result", str(results[-1])], cwd=str(ENTRY.parent.parent), stdout=log, stderr=subprocess.STDOUT,
            env=env(MASTER_ADDR=master.address, MASTER_PORT="29500", GLOO_SOCKET_IFNAME="eth0")))
        log.close()
    try:
        rcs = [p_.wait(args.timeout) for p_ in procs]
    except subprocess.TimeoutExpired:
        rcs = [-1]
    finally:
        for p_ in procs:
            lab["worker0"].stop(p_, 2.0)
    if any(rcs) or not all(r.exists() for r in results):
        tail = (workdir / "ddp-rank0.log").read_text(errors="replace")[-500:]
        return {"status": "failed", "error": f"exit codes {rcs}: {tail}"}
    ranks = [json.loads(r.read_text()) for r in results]
    dt = max(r["seconds"] for r in ranks)
    return {"status": "ok", "samples_per_sec": 2 * args.steps * args.batch / dt, "seconds": dt,
            "t_a": max(r["t_a"] for r in ranks), "t_b": min(r["t_b"] for r in ranks),
            "samples": 2 * args.steps * args.batch}


def run_dtrain(cluster: LabCluster, args: argparse.Namespace, workdir: Path, row: dict[str, Any]) -> dict[str, Any]:
    from dtrain_bench.children import dtrain_spec_dict, steady_state

    p = params(args, row["name"], mode=row["mode"], ps=row["ps"], workers=row.get("workers", 2))
    spec = dtrain_spec_dict(p)
    spec["cluster"].pop("dashboard", None)
    run_dir = workdir / f"run-{row['name']}-{time.time_ns()}"
    rc, summary = cluster.run_to_end(spec, run_dir, row["sets"], timeout=args.timeout, name=f"run-{row['name']}")
    if rc != 0 or not summary or summary.get("status") != "completed":
        err = (summary or {}).get("error") or cluster.log(f"run-{row['name']}", 800)
        return {"status": "failed", "error": f"exit {rc}: {err}"}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    k = row.get("workers", 2) if row["mode"] == "sync" else 1
    ss = steady_state(records, args.warmup, args.batch, k)
    if ss is None:
        return {"status": "failed", "error": "fewer than two metrics records after the warm-up"}
    sps, steps, ta, tb = ss
    return {"status": "ok", "samples_per_sec": sps, "t_a": ta, "t_b": tb, "seconds": tb - ta,
            "samples": steps * args.batch * k, "data_plane": summary.get("data_plane"),
            "summary_samples_per_sec": summary.get("samples_per_sec")}


def run_block(lab: Lab, cluster: LabCluster, sampler: LinkSampler, args: argparse.Namespace, workdir: Path,
              wanted: list[dict[str, Any]], rate: str, rep: int, link_rate: float) -> list[dict[str, Any]]:
    """One repetition of every row at one rate. The plain loop runs first and again last (the
    machine's load drifts: other users of a shared machine), and the mean of the two is the
    plain figure of the block that every ratio and link ceiling uses."""
    out, plains = [], []
    for row in [*wanted, wanted[0]]:
        t0 = time.time()
        if row["kind"] == "plain":
            res = run_plain(lab, args, workdir)
        elif row["kind"] == "ddp":
            res = run_ddp(lab, args, workdir, row["bf16"])
        else:
            res = run_dtrain(cluster, args, workdir, row)
        res.update(name=row["name"], label=row["label"], rate=rate, rep=rep, elapsed_s=round(time.time() - t0, 1))
        if row["kind"] == "plain":
            plains.append(res)
        else:
            out.append(res)
            if res["status"] == "ok" and (traffic := sampler.between(res["t_a"], res["t_b"])):
                res.update(summarize_traffic(traffic, res["samples"], res["seconds"], link_rate, None))
        line = (f"{res['samples_per_sec']:,.0f} samples/s" + (f", busiest link {res['busiest_link']}"
                if res.get("busiest_link") else "") if res["status"] == "ok" else f"FAILED {res.get('error')}")
        progress(f"[{rate} rep {rep + 1}] {row['label']}: {line} ({res['elapsed_s']:.0f} s)")
    ok = [p["samples_per_sec"] for p in plains if p["status"] == "ok"]
    plain = {**plains[0], "status": "ok" if ok else "failed", "samples_per_sec": statistics.mean(ok) if ok else None,
             "runs": [p.get("samples_per_sec") for p in plains]}
    for res in out:
        if res["status"] == "ok" and ok:
            res["ratio"] = res["samples_per_sec"] / plain["samples_per_sec"]
            if res.get("busiest_bytes_per_sample"):
                res["link_ceiling"] = link_rate / res["busiest_bytes_per_sample"] / plain["samples_per_sec"]
    progress(f"[{rate} rep {rep + 1}] plain: {', '.join(fmt(x) for x in plain['runs'])} samples/s (first, last)")
    return [plain, *out]


# ------------------------------------------------------------------------------------ report
def fmt(x: Any, spec: str = ",.0f") -> str:
    return "–" if x is None else format(x, spec)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| rate | row | samples/s | ratio to plain | link ceiling | busiest link | KB/sample there | "
             "% of link | shm conns |", "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        if r["status"] != "ok":
            err = " ".join(str(r.get("error")).split())[-100:].replace("|", "/")
            lines.append(f"| {r['rate']} | {r['label']} | FAILED: {err} | | | | | | |")
            continue
        dp = r.get("data_plane") or {}
        lines.append(
            f"| {r['rate']} | {r['label']} | {fmt(r['samples_per_sec'])} | {fmt(r.get('ratio'), '.2f')} | "
            f"{fmt(r.get('link_ceiling'), '.2f')} | {r.get('busiest_link') or '–'} | "
            f"{fmt((r.get('busiest_bytes_per_sample') or 0) / 1e3 or None, ',.1f')} | "
            f"{fmt(100 * r['busiest_utilisation'] if r.get('busiest_utilisation') else None, '.0f')} | "
            f"{dp.get('shared_memory_connections', '–')} |")
    return "\n".join(lines)


def median_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate, name): the repetition with the median samples/s."""
    out = []
    keys = list(dict.fromkeys((r["rate"], r["name"]) for r in results))
    for key in keys:
        rs = [r for r in results if (r["rate"], r["name"]) == key]
        ok = sorted((r for r in rs if r["status"] == "ok"), key=lambda r: r["samples_per_sec"])
        out.append(ok[len(ok) // 2] if ok else rs[0])
    return out


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ddp_rank is not None:
        return ddp_rank(args)
    why = probe()
    if why:
        print(f"lab_bench: the network lab cannot be built here ({why}); nothing was measured", file=sys.stderr)
        return 2
    main_rows = rows()[:1] if args.scaling_only else rows()
    wanted = main_rows + (scaling_rows() if args.scaling or args.scaling_only else [])
    if args.only:
        wanted = [r for r in wanted if r["name"] in {"plain", *args.only.split(",")}]
    tasks = TASKS + ([("worker", 2), ("worker", 3)] if any(r.get("workers", 2) > 2 for r in wanted) else [])
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="dtrain-lab-bench-"))
    doc: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:] if argv is None
                           else argv, "model": MODELS["w1"], "params": param_count(MODELS["w1"]),
                           "batch": args.batch, "warmup": args.warmup, "steps": args.steps, "tls": args.tls,
                           "hosts": host_names(tasks), "links": {}, "results": []}
    t_start = time.time()
    # SIGTERM as an exception: the lab tears itself down first (lab/network.py), then this ends
    # the run through the finally below, which writes what was measured and removes the workdir.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with Lab(host_names(tasks), rate=rates[0]) as lab:
            doc["addresses"] = {n: h.address for n, h in lab.hosts.items()}
            cluster = LabCluster(lab, tasks, workdir / "cluster", tls=args.tls)
            if any(r["kind"] == "dtrain" for r in wanted):
                cluster.start()
                progress(f"lab up: {', '.join(f'{n} {h.address}' for n, h in lab.hosts.items())}; "
                         f"cluster {cluster.address} ({time.time() - t_start:.0f} s)")
            try:
                with LinkSampler(lab) as sampler:
                    for rate in rates:
                        for name in lab.hosts:
                            lab.set_rate(name, rate)
                        one = statistics.median(blast(lab, [("worker0", "ps0")])[0] for _ in range(2))
                        both = blast(lab, [("worker0", "ps0"), ("ps0", "worker0")])
                        doc["links"][rate] = {"one_way_bytes_per_s": one, "duplex_bytes_per_s": both,
                                              "qdiscs": lab.qdiscs("ps0")}
                        progress(f"{rate}: raw TCP {one * 8 / 1e9:.2f} Gbit/s one way; both ways at once "
                                 f"{both[0] * 8 / 1e9:.2f} + {both[1] * 8 / 1e9:.2f} Gbit/s")
                        for rep in range(args.reps):
                            doc["results"] += run_block(lab, cluster, sampler, args, workdir, wanted, rate, rep, one)
            finally:
                cluster.close()
        doc["leftovers"] = lab.leftovers()
    finally:
        doc["elapsed_s"] = round(time.time() - t_start, 1)
        doc["table"] = median_rows(doc["results"])
        main = [r for r in doc["table"] if not r["name"].startswith("scale_")]
        scale = [r for r in doc["table"] if r["name"].startswith("scale_") or r["name"] == "plain"]
        md = table(main) + ("\n\nScaling (2 ps: placement.variables partitioned):\n\n" + table(scale)
                            if len(scale) > len([r for r in scale if r["name"] == "plain"]) else "")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        header = (f"dtrain across the network lab: {args.steps} timed steps after {args.warmup}, batch "
                  f"{args.batch}, {'TLS' if args.tls else 'plain TCP'}; link rates measured (raw TCP one way): "
                  + ", ".join(f"{k} {v['one_way_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s" for k, v in doc["links"].items()))
        args.out.with_suffix(".md").write_text(header + "\n\n" + md + "\n")
        print(header)
        print()
        print(md)
        print(f"\nresults: {args.out} (and {args.out.with_suffix('.md')}); {doc['elapsed_s']:.0f} s")
        if args.keep:
            print(f"logs and run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r["status"] != "ok" for r in doc["table"]) else 0


if __name__ == "__main__":
    sys.exit(main())
