#!/usr/bin/env python
"""dtrain's input pipeline benchmark (issue 14): memory, throughput and torch's DataLoader, one run.

Usage (from the repository root)::

    python benchmarks/input_bench.py                  # 0.2 GB and 2 GB datasets (written once, ~1 min)
    python benchmarks/input_bench.py --tiny           # 8 MB and 32 MB: that it runs (tests/test_bench.py)

What is measured, each in a fresh subprocess:

- ``stream_<size>``: one replica's input pipeline exactly as a replica builds it
  (``dtrain.worker.inputs.StreamBatches`` from a compiled plan: the replica's shards of a 2-replica
  plan, ``data.readers`` 2, ``data.prefetch`` 4, ``data.shuffle_buffer`` 10,000 -- the defaults --
  batch 128, standardised float32 tensors) reading its whole share of the dataset once. Peak RSS
  (``VmHWM``) and samples/s. The goal: the 2 GB dataset's peak within 100 MB of the 0.2 GB one
  (memory bounded by the buffers, never by the dataset).
- ``train``: the benchmark MLP (784-512-512-10, batch 128, SGD, one torch thread; bench.py's main
  model) in a plain PyTorch loop on data held in memory: the training rate of one replica. Goal:
  the input pipeline at least 3x it, so input never limits training.
- ``dataloader_<size>``: torch's ``DataLoader`` with the same number of workers (2) over the same
  parquet files: an ``IterableDataset`` whose workers take every other row group, shuffle it and
  yield batches of 128 (the usual way to feed parquet to torch), consumed once. Peak RSS (the
  loader process and its workers, summed) and samples/s.

The datasets (784 float32 features, an int64 label: ``examples/make_parquet_shards.py``) are
written once under ``--data`` (default: a temporary directory, removed at the end) in 16 files of
row groups of 8,192 rows. Results: ``benchmarks/results/input.json`` and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FEATURES, BATCH, HIDDEN = 784, 128, [512, 512]
PIPELINE = """
name: input-bench
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model: {{input_shape: [{features}], layers: [{{type: linear, out: 10}}], loss: cross_entropy}}
data: {{source: "{source}", batch_size: {batch}, epochs: 1, test_fraction: 0.05}}
"""


# ------------------------------------------------------------------------------------ children
def _peak_mb() -> float:
    """This process's peak RSS since it exec'd (VmHWM: ``ru_maxrss`` would also count the moments
    between fork and exec, when the child is a copy of this benchmark's large parent)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_stream(p: dict[str, Any]) -> dict[str, Any]:
    import pickle

    import torch

    from dtrain.plan.job import replica_job
    from dtrain.worker.inputs import StreamBatches

    torch.set_num_threads(1)
    with open(p["plan"], "rb") as f:
        spec, plan = pickle.load(f)
    idle = _peak_mb()
    from dtrain.errors import OutOfRange

    t0 = time.perf_counter()
    batches = StreamBatches(replica_job(spec, plan, 0), torch.device("cpu"))
    clock = _Clock(t0)
    try:
        while True:
            _x, y = batches.next()
            clock.batch(len(y))
    except OutOfRange:
        pass
    batches.close()
    return {**clock.result(), "peak_rss_mb": _peak_mb(), "idle_rss_mb": idle, "rows_assigned": plan.data.replicas[0].rows}


class _Clock:
    """Samples/s in the steady state (from the first batch on: the first batch's latency -- the
    readers' start and the first window -- is reported apart) and over the whole read."""

    def __init__(self, t0: float):
        self.t0, self.first, self.n, self.n_first = t0, None, 0, 0

    def batch(self, n: int) -> None:
        self.n += n
        if self.first is None:
            self.first, self.n_first = time.perf_counter(), self.n

    def result(self) -> dict[str, Any]:
        end = time.perf_counter()
        steady = (self.n - self.n_first) / (end - self.first) if self.first and end > self.first else 0.0
        return {"samples": self.n, "seconds": end - self.t0, "first_batch_s": (self.first or end) - self.t0,
                "samples_per_sec": steady, "overall_samples_per_sec": self.n / (end - self.t0)}


def child_train(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, width = [], FEATURES
    for h in HIDDEN:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4096, FEATURES), torch.randint(0, 10, (4096,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i: int) -> None:
        idx = torch.randint(0, 4096, (BATCH,))
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()

    for i in range(10):
        step(i)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < p["seconds"]:
        step(n)
        n += 1
    dt = time.perf_counter() - t0
    return {"samples": n * BATCH, "seconds": dt, "samples_per_sec": n * BATCH / dt}


def child_dataloader(p: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import psutil
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    torch.set_num_threads(1)
    files = sorted(Path(p["dir"]).glob("*.parquet"))
    groups = [(str(f), g) for f in files for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
    groups = groups[p["replica"]::2]  # one replica's half, as dtrain's plan gives it
    features = [f"f{j}" for j in range(FEATURES)]

    class RowGroups(IterableDataset):
        def __iter__(self):  # noqa: ANN204
            info = get_worker_info()
            mine = groups[info.id::info.num_workers] if info else groups
            rng = np.random.default_rng(info.id if info else 0)
            for path, g in mine:
                table = pq.ParquetFile(path).read_row_group(g)
                x = np.stack([table.column(c).to_numpy() for c in features], axis=1).astype(np.float32)
                y = table.column("label").to_numpy().astype(np.int64)
                order = rng.permutation(len(x))
                for i in range(0, len(x) - BATCH + 1, BATCH):
                    idx = order[i:i + BATCH]
                    yield torch.from_numpy(x[idx]), torch.from_numpy(y[idx])

    loader = DataLoader(RowGroups(), batch_size=None, num_workers=2, prefetch_factor=4, persistent_workers=False)
    me = psutil.Process()
    peak = 0.0
    clock = _Clock(time.perf_counter())
    for k, (_x, y) in enumerate(loader):
        clock.batch(len(y))
        if k % 20 == 0:
            rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
            peak = max(peak, rss / 2**20)
    return {**clock.result(), "peak_rss_mb": max(peak, _peak_mb())}


CHILDREN = {"stream": child_stream, "train": child_train, "dataloader": child_dataloader}


def run_child(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(params)], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=3600)
    if proc.returncode != 0:
        return {"status": "failed", "error": proc.stderr[-2000:]}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


# ------------------------------------------------------------------------------------ the run
def make_data(directory: Path, gb: float) -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    from make_parquet_shards import write_shards

    rows = int(gb * 2**30 / (4 * FEATURES + 8))
    if not (directory / "_done").exists():
        write_shards(directory, rows, files=16, features=FEATURES, classes=10, row_group=8192, seed=0)
        (directory / "_done").write_text(str(rows))
    return directory


def plan_for(directory: Path, workdir: Path) -> tuple[Path, int]:
    import pickle

    import dtrain
    from dtrain.chief.inputs import file_input, with_stats

    spec = dtrain.loads(PIPELINE.format(features=FEATURES, source=f"{directory}/*.parquet", batch=BATCH))
    data = file_input(spec)
    plan = with_stats(dtrain.compile(spec, data=data.manifests), data)
    path = workdir / f"plan-{directory.name}.pkl"
    path.write_bytes(pickle.dumps((spec, plan)))
    return path, data.train.rows + (data.test.rows if data.test else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="8 MB and 32 MB datasets (that it runs)")
    ap.add_argument("--data", type=Path, default=None, help="where to write (and keep) the datasets")
    ap.add_argument("--out", type=Path, default=RESULTS / "input.json")
    ap.add_argument("--train-seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))))
        return 0
    sizes = (0.0078125, 0.03125) if args.tiny else (0.2, 2.0)
    workdir = Path(tempfile.mkdtemp(prefix="dtrain-input-bench-"))
    data_root = args.data or workdir
    results: dict[str, Any] = {}
    try:
        for gb in sizes:
            tag = f"{gb:g}GB"
            t0 = time.perf_counter()
            directory = make_data(data_root / f"data-{tag}", gb)
            plan, rows = plan_for(directory, workdir)
            print(f"{tag}: {rows} rows ready in {time.perf_counter() - t0:.0f} s", flush=True)
            results[f"stream_{tag}"] = {"gb": gb, "rows": rows, **run_child("stream", {"plan": str(plan)})}
            results[f"dataloader_{tag}"] = {"gb": gb, "rows": rows,
                                            **run_child("dataloader", {"dir": str(directory), "replica": 0})}
        results["train"] = run_child("train", {"seconds": 2.0 if args.tiny else args.train_seconds})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    small, big = (f"stream_{g:g}GB" for g in sizes)
    summary: dict[str, Any] = {}
    if all(results[k]["status"] == "ok" for k in (small, big, "train")):
        train = results["train"]["samples_per_sec"]
        summary = {"rss_growth_mb": results[big]["peak_rss_mb"] - results[small]["peak_rss_mb"],
                   "input_over_training": {g: results[f"stream_{g:g}GB"]["samples_per_sec"] / train for g in sizes},
                   "stream_over_dataloader": {g: results[f"stream_{g:g}GB"]["samples_per_sec"]
                                              / results[f"dataloader_{g:g}GB"]["samples_per_sec"]
                                              for g in sizes if results[f"dataloader_{g:g}GB"]["status"] == "ok"}}
    doc = {"settings": {"tiny": args.tiny, "features": FEATURES, "batch": BATCH, "readers": 2, "prefetch": 4,
                        "shuffle_buffer": 10_000, "sizes_gb": list(sizes)}, "results": results, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"{'run':<22}{'rows':>10}{'samples/s':>12}{'first batch s':>15}{'peak RSS MB':>13}")
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:<22} FAILED: {r['error'][-300:]}")
            continue
        print(f"{name:<22}{r.get('rows', ''):>10}{r['samples_per_sec']:>12.0f}{r.get('first_batch_s', 0):>15.2f}"
              f"{r.get('peak_rss_mb', float('nan')):>13.0f}")
    if summary:
        print(f"replica RSS growth {sizes[0]:g} GB -> {sizes[1]:g} GB: {summary['rss_growth_mb']:+.0f} MB (goal: "
              "within 100 MB); input / training rate: " + ", ".join(
                  f"{k:g} GB {v:.1f}x" for k, v in summary["input_over_training"].items()) + " (goal: >= 3x); "
              "stream / DataLoader: " + ", ".join(f"{k:g} GB {v:.2f}x" for k, v in
                                                  summary["stream_over_dataloader"].items()))
    print(f"written: {args.out}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
