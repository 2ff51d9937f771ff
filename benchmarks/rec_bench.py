#!/usr/bin/env python
"""The recommendation benchmark: one DLRM on Criteo-layout data, TorchRec against plain PyTorch
(and, later, dtrain), side by side in one run.

Usage (from the repository root, with dtrain's venv; ``make bench-rec-env`` first for TorchRec)::

    python benchmarks/rec_bench.py                                  # 500k training rows, scale 0.01
    python benchmarks/rec_bench.py --rows 2000000 --files 8 --reps 3
    python benchmarks/rec_bench.py --data DIR                       # train*.tsv[.gz] + test*.tsv[.gz] in DIR
    python benchmarks/rec_bench.py --tiny --only torch              # a few thousand rows: that it runs

Every row trains the same model (benchmarks/rec/peers.py's docstring: bottom MLP 13-64-16, 26
tables of dim 16 with ``min(cardinality * scale, cap)`` rows, dot interaction, top MLP 367-64-1,
Adagrad lr 0.05) on the same files in the same order, batch 1024, one pass, one torch thread per
process, each row in its own subprocess, one row at a time:

- ``torchrec``: TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's table-batched embedding bags,
  ``EXACT_ROWWISE_ADAGRAD`` fused into backward), one process, in ``.venv-peers`` (skipped, with a
  line saying to run ``make bench-rec-env``, when that environment is missing);
- ``torch``: plain PyTorch, ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``, one
  process, in this interpreter's environment;
- ``dtrain``: 2 ps + 2 workers, ``dtrain run`` of the same model as a pipeline
  (:func:`dtrain_pipeline`) on its embedded cluster.

Reported per row: training samples/s (the training loop only: the peers parse every file before
the clock starts), the ratio to TorchRec's samples/s of the same repetition, the held-out log
loss and AUC, evaluation time and peak RSS. Repetitions (``--reps``) are interleaved (every other
one in reverse order); the table shows medians. JSON: ``benchmarks/results/rec_bench.json`` (``--out``).

Data: ``examples/make_criteo_like.py``'s seeded generator writes ``--files`` training files of
``--rows`` rows in all (C1..C3 multi-hot: ``--multi-hot``) and one held-out file as large as a
training file, with the same seed (the same hidden model), into ``train/`` and ``test/``, cached
under ``benchmarks/results/rec-data/`` (``--tiny``: a temporary directory, removed afterwards),
unless ``--data DIR`` names files.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEERS = ROOT / "benchmarks" / "rec" / "peers.py"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEERS_MISSING = f"{PEERS_PYTHON.relative_to(ROOT)} is missing: run make bench-rec-env"
GENERATOR = ROOT / "examples" / "make_criteo_like.py"
MAX_IDS = 4
"""The most ids of a multi-hot feature in generated data (the generator's default)."""
FIELDS = ("samples", "seconds", "samples_per_s", "eval_logloss", "eval_auc", "eval_seconds", "rss_mb")
"""What every row returns (more keys are kept in the JSON)."""


def progress(msg: str) -> None:
    print(f"[rec_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class RecData:
    """The data set every row trains on, and the table settings every row uses."""

    dir: str
    train: str  # glob of the training files
    test: str  # glob of the held-out files
    scale: float
    cap: int
    batch: int
    cardinalities: tuple[int, ...] | None = None  # None: peers.py's Criteo 1TB list
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _load_generator():
    if not GENERATOR.exists():
        raise SystemExit(f"{GENERATOR.relative_to(ROOT)} is missing (the generator comes with dtrain's data "
                         "work); pass --data DIR with train*.tsv[.gz] and test*.tsv[.gz] files instead")
    spec = importlib.util.spec_from_file_location("make_criteo_like", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(out: Path, rows: int, files: int, scale: float, seed: int, multi_hot: int) -> dict[str, Any]:
    """Write ``files`` training files (``rows`` in all, rounded up to a multiple of ``files``) and
    one held-out file of the same size with the generator; return what meta.json records.

    All ``files + 1`` come from one call with one seed: the held-out file shares the generator's
    hidden model (its weights and value codes follow from the seed) and only its rows differ."""
    gen = _load_generator()
    per_file = -(-rows // files)
    t0 = time.perf_counter()
    parts = gen.generate(out / "parts", rows=per_file * (files + 1), files=files + 1, seed=seed, scale=scale,
                         multi_hot=multi_hot, max_ids=MAX_IDS)
    for split, paths in (("train", parts[:-1]), ("test", parts[-1:])):
        (out / split).mkdir(parents=True, exist_ok=True)
        for p in paths:
            Path(p).rename(out / split / Path(p).name)
    (out / "parts").rmdir()
    return {"rows": per_file * files, "test_rows": per_file, "files": files, "scale": scale, "seed": seed,
            "multi_hot": multi_hot, "max_ids": MAX_IDS, "generator": str(GENERATOR.relative_to(ROOT)),
            "cardinalities": [int(c) for c in gen.CRITEO_1TB_CARDINALITIES],
            "seconds": round(time.perf_counter() - t0, 1)}


def prepare_data(args: argparse.Namespace, scratch: Path) -> RecData:
    """The data directory: --data as given, or the generator's files (cached by their settings)."""
    if args.data:
        d = Path(args.data)
        meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    else:
        name = f"rows{args.rows}-files{args.files}-scale{args.scale:g}-multihot{args.multi_hot}-seed{args.seed}"
        d = (scratch if args.tiny else Path(args.cache)) / name
        done = d / "meta.json"
        if done.exists():
            progress(f"data: reusing {d}")
        else:
            progress(f"data: generating {args.rows:,} training rows in {args.files} files into {d}")
            meta = generate(d, args.rows, args.files, args.scale, args.seed, args.multi_hot)
            done.write_text(json.dumps(meta, indent=1) + "\n")  # written last: the cache's completion mark
        meta = json.loads(done.read_text())
    train = _glob_of(d, "train")
    test = _glob_of(d, "test")
    cards = meta.get("cardinalities")
    return RecData(dir=str(d), train=train, test=test, scale=args.scale, cap=args.cap, batch=args.batch,
                   cardinalities=tuple(cards) if cards else None, seed=args.seed, meta=meta)


def _glob_of(d: Path, split: str) -> str:
    """The glob of one split's files in ``d`` (``train*``/``test*`` at the top or one level down)."""
    for pattern in (f"{split}*.tsv*", f"{split}*/*.tsv*"):
        if glob.glob(str(d / pattern)):
            return str(d / pattern)
    raise SystemExit(f"{d}: no {split} files ({split}*.tsv or {split}*.tsv.gz, or {split}*/ holding them)")


# ----------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    """One system under comparison: ``run(data, args, seed)`` trains the model on ``data`` from the
    training seed ``seed`` and returns at least :data:`FIELDS` (``status`` ``skipped`` with a
    ``reason`` when it cannot run here)."""

    name: str
    label: str
    run: Callable[[RecData, argparse.Namespace, int], dict[str, Any]]


def _peer(row: str, python: Path | str, missing: str | None = None):
    def run(data: RecData, args: argparse.Namespace, seed: int) -> dict[str, Any]:
        if missing and not Path(python).exists():
            return {"status": "skipped", "reason": missing}
        return run_peer(python, row, data, args.timeout, seed)

    return run


def run_peer(python: Path | str, row: str, data: RecData, timeout: float, seed: int) -> dict[str, Any]:
    """peers.py ``--row row`` from training seed ``seed`` in a fresh subprocess (its own process
    group, killed whole on a timeout)."""
    with tempfile.TemporaryDirectory(prefix="rec-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(PEERS), "--row", row, "--train", data.train, "--test", data.test,
               "--scale", repr(data.scale), "--cap", str(data.cap), "--batch", str(data.batch),
               "--seed", str(seed), "--out", str(out)]
        if data.cardinalities:
            cmd += ["--cardinalities", ",".join(map(str, data.cardinalities))]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=str(ROOT), start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"status": "failed", "error": f"exit {proc.returncode}", "log_tail": log[-3000:]}
        return {"status": "ok", **json.loads(out.read_text())}


DTRAIN_TABLE_LR = DTRAIN_DENSE_LR = 0.05


def dtrain_pipeline(data: RecData, max_ids: int, seed: int | None = None) -> str:
    """The benchmark's DLRM as a dtrain pipeline: the peers' model (fixed tables of the peers' rows,
    ids folded by modulo, row-wise Adagrad on the tables, Adagrad on the MLPs), 2 ps + 2 workers,
    each replica half of ``data.batch`` per step (so that each update, of both replicas' gradients,
    is a batch of ``data.batch`` as the peers' are: as many updates over the pass), one pass over the
    training files, synchronous (SyncReplicasOptimizer; the run is reproducible, where
    asynchronous updates at this learning rate sometimes kill the bottom MLP's ReLUs and end about
    0.06 worse in held-out log loss), default settings otherwise; ``seed``: the training seed
    (default: the data's)."""
    sys.path.insert(0, str(PEERS.parent))
    import peers

    cards = data.cardinalities or peers.CRITEO_1TB_CARDINALITIES
    rows = peers.table_rows(cards, data.scale, data.cap)
    multi = int(data.meta.get("multi_hot", 0))
    cats = ", ".join(f"{{name: C{i + 1}" + (f", max_ids: {max_ids}}}" if i < multi else "}") for i in range(26))
    tables = "\n".join(f"    C{i + 1}: {{num_embeddings: {n}, dim: 16, optimizer: {{name: rowwise_adagrad, "
                       f"lr: {DTRAIN_TABLE_LR}}}}}" for i, n in enumerate(rows))
    return f"""name: rec-bench
cluster: {{jobs: {{ps: 2, worker: 2}}}}
model:
  features:
    dense: [{", ".join(f"I{i}" for i in range(1, 14))}]
    categorical: [{cats}]
  tables:
{tables}
  dlrm: {{bottom: [64, 16], interaction: dot, top: [64, 1]}}
  loss: bce_with_logits
data: {{source: "{data.train}", eval_source: "{data.test}", batch_size: {max(1, data.batch // 2)}, epochs: 1}}
optimizer: {{name: adagrad, lr: {DTRAIN_DENSE_LR}}}
training: {{mode: sync, seed: {data.seed if seed is None else seed}}}
summary: {{tensorboard: false}}
"""


def run_dtrain(data: RecData, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The dtrain row: :func:`dtrain_pipeline` run by ``dtrain run`` on its embedded cluster (a fresh
    process, as a user runs it); samples/s over the training loop, as the peers time theirs: the
    samples over the longest replica's loop (its steps over its steps/s in summary.json's
    ``replicas_stats``: its first step to its last), so start-up (scheduling the tasks, building
    the model, connecting, reading the first file before the first batch) and the final
    evaluation are left out, while parsing the other files, which the replicas do as they train,
    stays in (the peers parse every file before their clock starts); the chief's ``train_s``
    (from the replicas' submission to their end) is kept as ``run_train_s``. Also the held-out log
    loss and AUC from its final evaluation, and the peak RSS of its largest process (its process
    tree sampled every 0.2 s; every process's own peak is kept too)."""
    import threading

    import psutil

    with tempfile.TemporaryDirectory(prefix="rec-bench-dtrain-") as tmp:
        pipeline = Path(tmp) / "rec.yaml"
        pipeline.write_text(dtrain_pipeline(data, int(data.meta.get("max_ids", MAX_IDS)), seed))
        run_dir = Path(tmp) / "run"
        proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                                env=dict(os.environ, PYTHONWARNINGS="ignore"), start_new_session=True)
        peaks: dict[int, int] = {}
        done = threading.Event()

        def sample() -> None:
            root = psutil.Process(proc.pid)
            while not done.wait(0.2):
                with contextlib.suppress(psutil.Error):
                    for p in [root, *root.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            log, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "failed", "error": f"timed out after {args.timeout} s"}
        finally:
            done.set()
            sampler.join()
        summary_path = run_dir / "summary.json"
        if proc.returncode != 0 or not summary_path.exists():
            return {"status": "failed", "error": f"dtrain run exited {proc.returncode}: {log[-2000:]}"}
        s = json.loads(summary_path.read_text())
        ev = s.get("eval") or {}
        loops = [r["steps"] / r["steps_per_s"] for r in (s.get("replicas_stats") or {}).values() if r.get("steps_per_s")]
        seconds = max(loops) if loops else s["train_s"]
        return {"status": "ok", "samples": s["samples"], "seconds": round(seconds, 3), "run_train_s": s["train_s"],
                "samples_per_s": s["samples"] / seconds, "eval_logloss": ev.get("log_loss"), "eval_auc": ev.get("auc"),
                "eval_seconds": None, "rss_mb": round(max(peaks.values(), default=0) / 2**20, 1),
                "process_rss_mb": sorted((round(v / 2**20, 1) for v in peaks.values()), reverse=True),
                "global_step": s["global_step"], "wall_s": s["wall_s"]}


ROWS: dict[str, Row] = {
    "torchrec": Row("torchrec", "TorchRec (FBGEMM TBE, fused row-wise Adagrad), 1 process",
                    _peer("torchrec", PEERS_PYTHON, missing=PEERS_MISSING)),
    "torch": Row("torch", "plain PyTorch (sparse EmbeddingBag + Adagrad), 1 process", _peer("torch", sys.executable)),
    "dtrain": Row("dtrain", "dtrain, 2 ps + 2 workers", run_dtrain),
}
DEFAULT_ROWS = ("torchrec", "torch", "dtrain")


def measure(row: Row, data: RecData, args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    """One row, once, from training seed ``seed``; never raises (a failed row is reported, the
    others still run)."""
    t0 = time.perf_counter()
    try:
        r = row.run(data, args, seed)
    except Exception as e:  # noqa: BLE001 - a row's failure is a result, including the placeholder's
        r = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    r.setdefault("status", "ok")
    r["wall_seconds"] = round(time.perf_counter() - t0, 2)
    if r["status"] == "ok" and (missing := [k for k in FIELDS if k not in r]):
        r = {"status": "failed", "error": f"result lacks {missing}"}
    return r


# --------------------------------------------------------------------------------------- report
def summarize(names: list[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: medians over its successful repetitions; ratio to TorchRec's rate of the same repetition."""
    ref = {r["rep"]: r["samples_per_s"] for r in runs if r["row"] == "torchrec" and r["status"] == "ok"}
    ref_loss = {r["rep"]: r["eval_logloss"] for r in runs if r["row"] == "torchrec" and r["status"] == "ok"}
    out = {}
    for name in names:
        mine = [r for r in runs if r["row"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            last = mine[-1]
            out[name] = {"status": last["status"], "error": last.get("error") or last.get("reason"),
                         "log_tail": last.get("log_tail")}
            continue
        ratios = [r["samples_per_s"] / ref[r["rep"]] for r in ok if r["rep"] in ref]
        s: dict[str, Any] = {"status": "ok", "reps": len(ok)}
        for k in FIELDS:
            values = [r[k] for r in ok if r[k] is not None]
            s[k] = statistics.median(values) if values else None
        s["ratio_to_torchrec"] = statistics.median(ratios) if ratios else None
        s["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
        # the held-out log loss against TorchRec's from the same seed (its median over the seeds)
        gaps = [r["eval_logloss"] - ref_loss[r["rep"]] for r in ok
                if r["rep"] in ref_loss and r["eval_logloss"] is not None and ref_loss[r["rep"]] is not None]
        s["logloss_vs_torchrec"] = statistics.median(gaps) if gaps else None
        out[name] = s
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| row | samples/s | ratio to TorchRec | eval log loss | vs TorchRec | AUC | eval s | peak RSS MB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in summary.items():
        label = ROWS[name].label
        if s["status"] != "ok":
            lines.append(f"| {label} | {s['status']} | | | | | | |")
            continue
        ratio = "–" if s["ratio_to_torchrec"] is None else f"{s['ratio_to_torchrec']:.2f}"
        if s["ratio_range"] and s["reps"] > 1:
            ratio += f" ({s['ratio_range'][0]:.2f}–{s['ratio_range'][1]:.2f})"
        evals = "-" if s["eval_seconds"] is None else f"{s['eval_seconds']:.1f}"  # (dtrain's is inside its run)
        gap = "–" if s.get("logloss_vs_torchrec") is None else f"{s['logloss_vs_torchrec']:+.4f}"
        lines.append(f"| {label} | {s['samples_per_s']:,.0f} | {ratio} | {s['eval_logloss']:.4f} | {gap} | "
                     f"{s['eval_auc']:.4f} | {evals} | {s['rss_mb']:,.0f} |")
    notes = [f"{name}: {s['status']}: {s['error']}" for name, s in summary.items() if s["status"] != "ok"]
    return "\n".join(lines + [""] + notes)


def machine() -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "loadavg_start": list(os.getloadavg())}
    for pkg in ("torch", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[pkg] = metadata.version(pkg)
    return info


# ----------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000, help="training rows to generate (all files together)")
    ap.add_argument("--files", type=int, default=4, help="training files to generate")
    ap.add_argument("--scale", type=float, default=0.01, help="cardinality scale: the generator's and the tables'")
    ap.add_argument("--multi-hot", type=int, default=3,
                    help="the generator's first N categorical features are multi-hot (1 to 4 ids)")
    ap.add_argument("--cap", type=int, default=40_000_000, help="most rows of one table")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", help="a directory of train*.tsv[.gz] and test*.tsv[.gz] files: no generation")
    ap.add_argument("--cache", default=str(RESULTS / "rec-data"), help="where generated data is kept for reuse")
    ap.add_argument("--only", help="comma-separated rows (torchrec, torch, dtrain)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row and repetition")
    ap.add_argument("--tiny", action="store_true", help="4,000 rows in 2 files, scale 0.001: that it runs")
    ap.add_argument("--out", default=str(RESULTS / "rec_bench.json"))
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.files, args.scale = 4000, 2, 0.001
    names = args.only.split(",") if args.only else list(DEFAULT_ROWS)
    if bad := [n for n in names if n not in ROWS]:
        ap.error(f"--only: {', '.join(bad)} not among {', '.join(ROWS)}")
    args.names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="rec-bench-data-"))
    try:
        data = prepare_data(args, scratch)
        info = machine()
        runs = []
        for rep in range(args.reps):
            # Every other repetition in reverse order: no row always runs right after another. Each
            # repetition trains every row from its own seed: the held-out log loss moves with the
            # seed by more than the rows differ (0.41 to 0.43 on the default data), so the rows are
            # compared seed by seed, and by their medians.
            seed = data.seed + rep
            for name in args.names if rep % 2 == 0 else args.names[::-1]:
                progress(f"rep {rep + 1}/{args.reps} (seed {seed}): {name}")
                r = measure(ROWS[name], data, args, seed)
                runs.append({"row": name, "rep": rep, "seed": seed, **r})
                if r["status"] == "ok":
                    progress(f"  {r['samples_per_s']:,.0f} samples/s, eval log loss {r['eval_logloss']:.4f}, "
                             f"AUC {r['eval_auc']:.4f}")
                else:
                    progress(f"  {r['status']}: {r.get('error') or r.get('reason')}")
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(args.names, runs)
    settings = {k: v for k, v in vars(args).items() if k not in ("names",)}
    doc = {"machine": info, "settings": settings, "data": asdict(data), "results": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"DLRM on Criteo-layout data: {data.meta.get('rows', '?')} training rows, batch {args.batch}, "
          f"scale {args.scale:g}, cap {args.cap:,}, one thread per process; load {info['loadavg_start'][0]:.2f}"
          f" -> {info['loadavg_end'][0]:.2f}\n")
    print(table(summary))
    print(f"\nresults: {out}")
    failed = [n for n, s in summary.items() if s["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
