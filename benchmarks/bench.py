#!/usr/bin/env python
"""dtrain's benchmark: throughput against plain PyTorch and torch DDP, in one run.

Usage (from the repository root; ``make bench`` runs the first line)::

    python benchmarks/bench.py                   # the main table, median of 3 interleaved repetitions
    python benchmarks/bench.py --reps 5          # more repetitions
    python benchmarks/bench.py --tiny            # 64-128-10 MLP, 1 rep, a few configs: per-step fixed cost
    python benchmarks/bench.py --scaling         # + scaling curves (model size x ps shards) -> scaling.png
    python benchmarks/bench.py --set training.transport=dask   # extra overrides for every dtrain spec
    python benchmarks/bench.py --observe         # telemetry's overhead: each config with it on and off
    python benchmarks/bench.py --link 1gbit      # every config across an emulated 1 Gbit/s link (exit 2 if impossible)

What is measured (see benchmarks/README.md for how to read the output)
---------------------------------------------------------------------
Every configuration trains the same model (synthetic 784-512-512-10 MLP, 669,706 parameters;
``--tiny``: 64-128-10) with the same batch per replica (128), the same optimizer (SGD lr 0.01)
and one torch thread per process, on synthetic data held in memory:

- ``plain``: a plain PyTorch loop (model, SGD, ``zero_grad``/forward/loss/backward/step on a
  batch drawn from a preloaded tensor) in its own subprocess with ``torch.set_num_threads(1)``.
  Timed for at least ``--steps`` steps and at least ``--min-seconds`` after ``--warmup`` steps.
- ``plain_x2``: two such processes started side by side (the ceiling of this machine for two
  replicas); their rates are summed (approximate: the two timed windows overlap almost fully).
- ``ddp_gloo_2``: torch DistributedDataParallel, gloo backend, 2 processes
  (``torch.multiprocessing.spawn``, rendezvous on 127.0.0.1 at a free port); a barrier before and
  after the timed window; samples/s = 2 x steps x batch / window.
- ``async_1ps_1w``, ``async_1ps_2w`` (``training.overlap: true``), ``sync_1ps_2w``,
  ``ingraph_1ps_2w``: ``dtrain.run`` on an embedded cluster of real worker processes (one per
  task), each in a fresh subprocess. The cluster is started by the benchmark with
  ``dtrain.deploy.cluster.connect(spec)`` and handed to ``dtrain.run(spec, client=...)`` so that the
  workers' memory can be read before and after the run. All on one machine, so the data plane
  uses its shared-memory slots (``training.shared_memory``, the default).
- ``sync_1ps_2w_tcp`` and ``sync_1ps_2w_tcp_buckets``: sync 1 ps + 2 workers with
  ``training.shared_memory: false`` (the bytes cross the socket, as between machines), the
  gradient pushed whole after backward (``bucket_mb: 0``) or in 1 MB buckets during backward.

dtrain's steady-state throughput is derived from ``metrics.jsonl`` (records every
``summary.every_steps`` global steps, each with the ps task's wall-clock ``time``), using the
first record at or after the warm-up step W and the last record (step W + T)::

    samples/s = (step_b - step_a) x batch x k / (time_b - time_a)

with k = 1 in async mode (a global step is one replica's push of ``batch`` samples) and
k = replicas_to_aggregate in sync/in-graph mode (a global step averages that many replicas'
batches). This leaves out cluster start-up, replica start-up and the final evaluation, which
``summary.json``'s ``samples_per_sec`` (samples over all of ``train_s``) includes; that figure is
kept in the JSON as ``summary_samples_per_sec``. When fewer than two records follow the warm-up,
the summary figure is used and the result is marked ``method: summary``.

Per-replica step time = replicas x batch / samples/s (for sync with all replicas aggregated this
is the wall time of one global step). The *fixed cost per step* is that minus the plain loop's
step time in the same repetition; with one replica it is dtrain's own per-step overhead (issue
7 asks for it on the tiny model); with two replicas on two cores it also contains core sharing.

Ratios: every configuration's samples/s divided by the plain loop's samples/s *of the same
repetition*; repetitions are interleaved (rep 1 of every configuration, then rep 2, ...), so slow
drifts of a shared machine hit all configurations alike. The table shows the median of the
samples/s, the median ratio and its range (min-max over repetitions).

Memory: before each dtrain run, every worker imports torch and dtrain's ps/replica modules and
its RSS is read ("idle"); after the run, each worker's peak RSS (``getrusage`` ``ru_maxrss``) is
read. "state" is what the ps must hold: parameter bytes (``dtrain.compile(spec).ps_bytes``)
plus optimizer-state bytes (sgd: 0, sgd with momentum / momentum / adagrad: 1x, adam: 2x,
amsgrad: 3x the parameters). The table shows ps (peak - idle) / state.

Scaling (``--scaling``): for hidden sizes 256, 512, 1024, 2048 (784-H-H-10) and 1 or 2 ps shards
(2 shards: ``placement.variables: partitioned`` so the bytes are balanced), dtrain async with 1
worker and ``overlap: false`` (every exchange is on the critical path) beside the plain loop of
the same size (run before and after them; the mean is used). Bytes moved per step = 2 x
parameter bytes (one fp32 gradient push and one fp32 parameter reply per global step; the
protocol's figure) and, as a cross-check, the loopback interface's byte counter per step (the
median over the summary intervals after the warm-up; machine-wide, so other traffic on
127.0.0.1 can add to it). Effective exchange rate = bytes per step / (dtrain step time - plain
step time). Beside it, a raw loopback TCP round trip (a subprocess echoing a buffer back,
``sendall``/``recv_into`` on preallocated buffers) is measured in the same run at the same sizes
and at 16 MiB; rate = 2 x size / round-trip time. Plotted to ``benchmarks/results/scaling.png``.

Numbers live here, never in tests: tests/test_bench.py only checks that ``--tiny`` runs.

Implementation note: the code lives in the package ``benchmarks/dtrain_bench/`` (``configs``:
what is measured; ``children``: what runs in the child processes; ``runner``: starting and killing
them; ``report``: the main table; ``scaling``: the sweep; ``machine``: machine info, loopback
counter and round trip; ``link``: ``--link``'s namespace, shaped loopback, rows and goals); this file parses the arguments and runs the repetitions. It is also
imported by Dask's spawned worker processes (as ``__mp_main__``) and by torch.multiprocessing's
children, so it and the package import only the standard library at their top level; torch, dask
and dtrain are imported inside the functions that need them. What a child process unpickles by
reference (the DDP rank, the workers' memory probe) lives in the package, which this file puts on
``sys.path``.
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

# Makes the dtrain_bench package beside this file importable (run as a script, this folder is
# sys.path[0] already); spawned children inherit sys.path and import this file as __mp_main__.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtrain_bench.children import run_child
from dtrain_bench.configs import (
    ENTRY,
    MODELS,
    RESULTS,
    SCALING_HIDDEN,
    main_configs,
    observe_configs,
    optimizer_for,
    param_count,
    progress,
)
from dtrain_bench.goals import one_machine, print_goals
from dtrain_bench.link import (
    annotate,
    goals,
    header_line,
    link_configs,
    measure_link,
    parse_rate,
    print_link,
    reexec,
    setup_inside,
)
from dtrain_bench.machine import loadavg, machine_info
from dtrain_bench.overhead import pair_order, print_overhead, print_ps_cost
from dtrain_bench.report import median, print_main, summarize
from dtrain_bench.runner import Runner
from dtrain_bench.scaling import plot_scaling, print_scaling, run_scaling
from dtrain_bench.sparse import SIZES as SPARSE_SIZES
from dtrain_bench.sparse import print_sparse, run_sparse, summarize_sparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3; --tiny: 1)")
    ap.add_argument("--warmup", type=int, default=None, help="dtrain warm-up global steps (default 100; --tiny 50)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps: dtrain global steps, plain/DDP steps per process (default 500; --tiny 200)")
    ap.add_argument("--every", type=int, default=None, help="dtrain summary.every_steps (default 50)")
    ap.add_argument("--plain-warmup", type=int, default=50, help="warm-up steps of the plain and DDP loops")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="the plain loop runs at least this long (default 3; --tiny 1)")
    ap.add_argument("--batch", type=int, default=128, help="batch size per replica")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adagrad"])
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--num-samples", type=int, default=8192, help="synthetic training set size")
    ap.add_argument("--tiny", action="store_true",
                    help="64-128-10 MLP, 1 rep, plain + dtrain async 1+1 + sync 1+2: per-step fixed cost")
    ap.add_argument("--only", default=None, help="comma-separated config names to run (plain is always run)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override for every dtrain spec (as `dtrain run --set`), repeatable")
    ap.add_argument("--observe", action="store_true",
                    help="telemetry's overhead: async 1+1, async 1+2, sync 1+2 with observe.telemetry on and off")
    ap.add_argument("--scaling", action="store_true", help="also run the scaling sweep and plot it")
    ap.add_argument("--scaling-only", action="store_true", help="run only the scaling sweep")
    ap.add_argument("--scaling-reps", type=int, default=1)
    ap.add_argument("--hidden", type=int, nargs="+", default=list(SCALING_HIDDEN), help="scaling hidden sizes")
    ap.add_argument("--plot", type=Path, default=RESULTS / "scaling.png", help="scaling plot path")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench.json", help="JSON results path")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to each measurement")
    ap.add_argument("--keep-runs", action="store_true", help="keep the dtrain run directories and child logs")
    ap.add_argument("--sparse", action="store_true",
                    help="run only the sparse embedding table comparison (10^4, 10^6, 10^7 rows; README)")
    ap.add_argument("--sparse-rows", type=int, nargs="+", default=None, help="table sizes for --sparse")
    ap.add_argument("--sparse-warmup", type=int, default=20, help="--sparse warm-up steps")
    ap.add_argument("--sparse-steps", type=int, default=200, help="--sparse timed steps")
    ap.add_argument("--sparse-every", type=int, default=10, help="--sparse dtrain summary.every_steps")
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="run every configuration across an emulated link of RATE (tc's syntax: 10gbit, 1gbit, "
                         "100mbit): a private network namespace whose loopback is shaped by tbf; exit 2 if it cannot "
                         "be made (README)")
    ap.add_argument("--link-inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tiny = args.tiny
    if args.link is not None:
        try:
            parse_rate(args.link)
        except ValueError as exc:
            ap.error(f"--link: {exc}")
        if args.sparse or args.observe or args.scaling or args.scaling_only:
            ap.error("--link runs the main table only (not with --sparse, --observe, --scaling, --scaling-only)")
    if args.sparse:
        args.reps = args.reps or 1
        args.sparse_rows = args.sparse_rows or list(SPARSE_SIZES)
        args.timeout = max(args.timeout, 600.0)
        if args.sparse_warmup % args.sparse_every or args.sparse_steps % args.sparse_every:
            ap.error(f"--sparse-warmup and --sparse-steps must be multiples of --sparse-every ({args.sparse_every})")
    args.reps = args.reps if args.reps is not None else (1 if tiny else 3)
    args.warmup = args.warmup if args.warmup is not None else (50 if tiny else 100)
    args.steps = args.steps if args.steps is not None else (200 if tiny else 500)
    args.every = args.every if args.every is not None else 50
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (1.0 if tiny else 3.0)
    if args.warmup % args.every or args.steps % args.every:
        ap.error(f"--warmup and --steps must be multiples of --every ({args.every})")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args.params, args.result)
    if args.sparse:
        return main_sparse(args, argv)
    if args.link and not args.link_inside:  # again, inside a private network namespace
        return reexec(args.link, list(sys.argv[1:] if argv is None else argv), str(ENTRY))
    model = MODELS["tiny" if args.tiny else "w1"]
    link: dict[str, Any] | None = None
    if args.link:
        err, show = setup_inside(args.link)
        if err:
            print(f"--link {args.link}: {err}; nothing was measured", file=sys.stderr)
            return 2
        link = {"rate": args.link, "rate_bits": parse_rate(args.link), "qdisc": show, "raw": []}
        configs = link_configs(args.tiny)
    else:
        configs = observe_configs() if args.observe else main_configs(args.tiny)
    if args.only:
        wanted = {"plain", *args.only.split(",")}
        unknown = wanted - {c.name for c in configs}
        if unknown:
            print(f"unknown config(s): {', '.join(sorted(unknown))}; known: "
                  f"{', '.join(c.name for c in configs)}", file=sys.stderr)
            return 2
        configs = [c for c in configs if c.name in wanted]
    meta: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine_info(),
        "settings": {"model": model, "params": param_count(model), "batch": args.batch, "threads": args.threads,
                     "optimizer": optimizer_for(args.optimizer, args.lr), "reps": args.reps, "warmup": args.warmup,
                     "steps": args.steps, "every": args.every, "plain_warmup": args.plain_warmup,
                     "min_seconds": args.min_seconds, "num_samples": args.num_samples, "tiny": args.tiny,
                     "overrides": args.set, "interleaved": True, "link": args.link},
        "method": ("samples/s: plain/DDP over their timed loop; dtrain from metrics.jsonl records after the "
                   "warm-up: delta global steps x batch x (1 async | replicas_to_aggregate sync) / delta time. "
                   "ratio: to the plain loop of the same repetition; median and range over repetitions."),
    }
    workdir = Path(tempfile.mkdtemp(prefix="dtrain-bench-"))
    runner = Runner(args, workdir)
    doc: dict[str, Any] = dict(meta)
    rc = 0
    try:
        if link is not None:
            doc["link"] = link
            link["raw"].append(measure_link(4 * param_count(model)))
            progress(f"link {args.link}: raw round trip {link['raw'][0]['bytes_per_s'] / 1e6:,.1f} MB/s")
        if not args.scaling_only:
            runs: list[dict[str, Any]] = []
            for rep in range(args.reps):
                for cfg in pair_order(configs, rep, args.observe):
                    t0 = time.time()
                    res = runner.measure(cfg, model, rep, args.warmup, args.steps, args.every)
                    res.update(config=cfg.name, rep=rep, elapsed_s=round(time.time() - t0, 1))
                    runs.append(res)
                    plain = next((r for r in runs if r["config"] == "plain" and r["rep"] == rep
                                  and r.get("status") == "ok"), None)
                    if res.get("status") == "ok":
                        ratio = (f", ratio {res['samples_per_sec'] / plain['samples_per_sec']:.2f}"
                                 if plain and cfg.name != "plain" else "")
                        progress(f"[rep {rep + 1}/{args.reps}] {cfg.label}: {res['samples_per_sec']:,.0f} samples/s"
                                  f"{ratio} ({res['elapsed_s']:.0f} s)")
                    else:
                        progress(f"[rep {rep + 1}/{args.reps}] {cfg.label}: FAILED: {res.get('error')}")
            results = summarize(configs, runs, args.reps)
            doc["machine"]["loadavg_end"] = loadavg()
            doc["results"] = results
            doc["runs"] = runs
            if link is not None:
                link["raw"].append(measure_link(4 * param_count(model)))
                link["bytes_per_s"] = median([x["bytes_per_s"] for x in link["raw"]])
                annotate(results, runs, link)
                link["goals"] = goals(results, runs, link["rate_bits"])
                link["header"] = header_line(link)
            print_main(results, doc, args.tiny)
            if link is not None:
                print_link(results, link)
            else:
                changed = [f"--set {kv}" for kv in args.set] + ([f"--optimizer {args.optimizer}"]
                                                               if args.optimizer != "sgd" else [])
                doc["goals"] = one_machine(results, args.tiny, changed)
                print_goals(doc["goals"], changed)
            if args.observe:
                doc["telemetry_overhead"] = print_overhead(runs)
                doc["telemetry_ps_cost"] = print_ps_cost(model)
            if any(r["status"] == "failed" for r in results.values()):
                rc = 1
        if args.scaling or args.scaling_only:
            sc = run_scaling(runner, args)
            doc["scaling"] = sc
            doc["machine"]["loadavg_end"] = loadavg()
            print_scaling(sc)
            try:
                plot_scaling(sc, args.plot)
                sc["plot"] = str(args.plot)
                print(f"scaling plot: {args.plot}")
            except Exception as exc:  # a plotting problem must not lose the measurements
                sc["plot_error"] = f"{type(exc).__name__}: {exc}"
                print(f"scaling plot failed: {sc['plot_error']}", file=sys.stderr)
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        tmp.replace(args.out)
        print(f"results: {args.out}")
        if args.keep_runs:
            print(f"run directories and child logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return rc


def main_sparse(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--sparse``: the embedding table comparison (dtrain_bench/sparse.py); exit 1 if a run failed."""
    doc: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "argv": sys.argv[1:] if argv is None else argv, "machine": machine_info()}
    workdir = Path(tempfile.mkdtemp(prefix="dtrain-bench-sparse-"))
    out = args.out if args.out != RESULTS / "bench.json" else RESULTS / "sparse.json"
    try:
        sp = run_sparse(Runner(args, workdir), args)
        doc["sparse"] = sp
        doc["table"] = table = summarize_sparse(sp)
        doc["goals_missed"] = print_sparse(table)
        rc = 1 if any(r["failed"] for r in table) else 0
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"results: {out}")
        if not args.keep_runs:
            shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
