"""Table scale: ``pipelines/dlrm_criteo_1tb.yaml`` whole (26 tables, 187.8M rows in bfloat16 with
row-wise Adagrad: about 6.3 GiB of rows and state on 2 ps tasks) on Criteo-layout data from
``examples/make_criteo_like.py``, trained by ``dtrain run`` as a user runs it, with checkpoints
every ``--every`` steps, then resumed from its newest checkpoint.

Reported (and written to ``benchmarks/results/table_scale.json``):

- training: samples/s and seconds per step over the training loop (``summary.json``);
- memory: each process's peak RSS (the tree sampled every 0.2 s), each ps task's steady RSS (the
  median outside checkpoints) against its rows plus their optimizer state (goal: within 1.3x) and
  its peak during checkpoints (goal: at most 1.2x its steady RSS), the chief's peak (goal: under
  1 GiB whatever the tables' size), each worker's (goal: under 1 GiB);
- checkpoints: their size, the seconds from the snapshot to the commit, and the seconds training
  was held for each snapshot (``checkpoint_stall_s``), per GiB snapshotted (goal: under 1 s) and
  as a share of the step time over a 500-step interval (goal: under 2%);
- incremental checkpoints (the pipeline's ``checkpoint.incremental``): each checkpoint's kind and
  size, and the first delta's size against the full checkpoint before it (goal: at least 5x
  smaller at 500 steps);
- the resume: seconds outside its training loop (the restore of the newest checkpoint, the full
  part and the deltas after it, on each ps task; the evaluation; ``model.pt``).

Goals are printed beside the figures; nothing here asserts them.

    python benchmarks/table_scale.py                # 1,000,000 generated lines (about 6 minutes)
    python benchmarks/table_scale.py --rows 200000  # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "dlrm_criteo_1tb.yaml"
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30


def generate(out: Path, rows: int, files: int, seed: int) -> None:
    spec = importlib.util.spec_from_file_location("make_criteo_like", ROOT / "examples" / "make_criteo_like.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(out, rows=rows, files=files, seed=seed, scale=1.0, multi_hot=2, max_ids=3)


class Sampler:
    """Each process of a tree's RSS every 0.2 s, with the time (for steady vs checkpoint)."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.parents: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            now = time.time()
            with contextlib.suppress(psutil.Error):
                for p in [self.root, *self.root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        self.parents.setdefault(p.pid, p.ppid())
                        self.samples.setdefault(p.pid, []).append((now, p.memory_info().rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(args: list[str], cwd: Path, timeout: float) -> tuple[int, str, Sampler, float]:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", *args], cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    sampler = Sampler(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        sampler.stop()
    return proc.returncode, out, sampler, t0


def checkpoint_windows(log: str) -> list[dict[str, Any]]:
    """The log's ``checkpoint NAME (W s; training held H s)`` lines."""
    pat = re.compile(r"checkpoint (ckpt-\d+) \(([\d.]+) s; training held ([\d.]+) s\)")
    return [{"name": m.group(1), "write_s": float(m.group(2)), "held_s": float(m.group(3))} for m in pat.finditer(log)]


def kinds_and_sizes(log: str, ckpt_dir: Path, seen: dict[str, Any]) -> list[dict[str, Any]]:
    """Each checkpoint the run wrote (its log lines), with its kind and the bytes of its own parts,
    from its parts' reports (``shard-*.json``): noted by :func:`watch_sizes` while the run went on
    (retention deletes old checkpoints), or read from the directory when it is still there."""
    out, previous = [], None
    for w in checkpoint_windows(log):
        name = w["name"]
        entry = seen.get(name) or _sizes(ckpt_dir / name)
        if entry is None:
            continue
        step = int(name.split("-")[1])
        out.append({"name": name, "kind": entry["kind"], "bytes": entry["bytes"],
                    "steps": step - previous if previous is not None else None})
        previous = step
    return out


def _sizes(directory: Path) -> dict[str, Any] | None:
    reports = [json.loads(p.read_text()) for p in directory.glob("shard-*.json")] if directory.is_dir() else []
    if not reports:
        return None
    return {"kind": "delta" if any(r.get("kind") == "delta" for r in reports) else "full",
            "bytes": sum(int(r["bytes"]) for r in reports)}


def watch_sizes(ckpt_dir: Path, stop: threading.Event, seen: dict[str, Any]) -> None:
    """Note every committed checkpoint's kind and size in ``seen`` before retention removes it."""
    while not stop.wait(0.5):
        for manifest in sorted(ckpt_dir.glob("ckpt-*.json")) if ckpt_dir.is_dir() else []:
            name = manifest.stem
            if name not in seen and (entry := _sizes(ckpt_dir / name)) is not None:
                seen[name] = entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="generated lines (all files together)")
    ap.add_argument("--files", type=int, default=5)
    ap.add_argument("--every", type=int, default=100, help="checkpoint.every_steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(RESULTS / "table_scale.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="table-scale-") as tmp:
        data = Path(tmp) / "data"
        t = time.time()
        generate(data, args.rows, args.files, args.seed)
        print(f"data: {args.rows:,} lines in {args.files} files ({time.time() - t:.0f} s)", flush=True)
        run_dir = Path(tmp) / "run"
        common = [str(PIPELINE), "--run-dir", str(run_dir), "--set", f"data.source={data}/",
                  "--set", f"checkpoint.every_steps={args.every}"]
        stop, seen = threading.Event(), {}
        watcher = threading.Thread(target=watch_sizes, args=(run_dir / "checkpoints", stop, seen), daemon=True)
        watcher.start()
        code, log, sampler, t0 = run(common, ROOT, args.timeout)
        stop.set()
        watcher.join()
        if code != 0:
            print(log[-4000:])
            return 1
        summary = json.loads((run_dir / "summary.json").read_text())
        cluster = json.loads((run_dir / "cluster.json").read_text())
        windows = checkpoint_windows(log)
        ckpt_dir = run_dir / "checkpoints"
        newest = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.with_suffix(".json").exists())[-1]
        size = sum(f.stat().st_size for f in newest.iterdir())
        kinds = kinds_and_sizes(log, ckpt_dir, seen)
        roles = {int(t["pid"]): task for task, t in cluster["tasks"].items() if t.get("pid")}
        manifests = [json.loads(p.read_text()) for p in ckpt_dir.glob("ckpt-*.json")]
        times = sorted(m["time"] for m in manifests)
        procs = {}
        for pid, series in sampler.samples.items():
            role = "chief" if pid == sampler.root.pid else roles.get(pid) or (
                f"{roles[sampler.parents[pid]]}'s checkpoint writer" if sampler.parents.get(pid) in roles else None)
            if role is None:
                continue  # (the scheduler, nannies, the forkserver)
            rss = [r for _, r in series]
            # steady: samples at least 5 s away from any checkpoint commit, in the training's second half
            steady = [r for ts, r in series if all(abs(ts - c) > 5 for c in times)]
            procs[f"{role} ({pid})"] = {"peak_gib": max(rss) / GIB,
                                        "steady_gib": statistics.median(steady[len(steady) // 2:]) / GIB
                                        if steady else None}
        step_s = summary["train_s"] / max(1, summary["global_step"] - summary.get("start_step", 0))
        held = [w["held_s"] for w in windows]
        size_gib = size / GIB
        # The resume: from its start to its first step (the restore of every part on its ps task).
        code2, log2, _, t2 = run([*common, "--resume", "--profile-startup", "--set",
                                  f"training.steps={summary['global_step'] + 20}", "--set", "data.epochs=null"],
                                 ROOT, args.timeout)
        resumed = json.loads((run_dir / "summary.json").read_text()) if code2 == 0 else {}
        restore_s = (resumed.get("wall_s", 0) - resumed.get("train_s", 0)) if resumed else None
        # (--profile-startup's phase: the ps actors created and each restored from its chain of parts)
        m = re.search(r"^ps actors created, replicas submitted\s+([\d.]+)", log2, re.M)
        restore_parts_s = float(m.group(1)) if m else None
    result = {
        "rows": args.rows, "every_steps": args.every, "samples_per_s": summary["samples_per_sec"],
        "step_s": step_s, "global_step": summary["global_step"], "eval": summary.get("eval"),
        "checkpoint_gib": size_gib, "checkpoints": windows, "checkpoint_stall_s": summary.get("checkpoint_stall_s"),
        "checkpoint_waits": summary.get("checkpoint_waits"), "processes": procs, "incremental": kinds,
        "resume_to_end_s": restore_s, "resume_status": resumed.get("status"), "restore_s": restore_parts_s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    rows_state_gib = 187_767_399 * (16 * 2 + 4) / GIB / 2  # per ps task: bfloat16 rows + a float32 row accumulator
    print(f"\ntraining: {summary['samples_per_sec']:,.0f} samples/s, {step_s * 1000:.0f} ms/step, "
          f"eval {summary.get('eval')}")
    written = ", ".join(f"{w['write_s']:.1f}" for w in windows)
    print(f"checkpoint: {size_gib:.2f} GiB; written in {written} s; "
          f"training held {', '.join(f'{h:.3f}' for h in held)} s")
    full_gib = max((k["bytes"] for k in kinds if k["kind"] == "full"), default=size) / GIB
    if held:  # (a delta's snapshot holds the whole task too: per GiB of the tables, a full checkpoint's size)
        worst = max(held)
        print(f"  held per GiB snapshotted: {worst / full_gib:.3f} s (goal < 1 s); over a 500-step interval: "
              f"{100 * statistics.mean(held) / (500 * step_s):.2f}% of the step time (goal < 2%)")
    full = next((k for k in kinds if k["kind"] == "full"), None)
    delta = next((k for k in kinds if k["kind"] == "delta"), None)
    print("checkpoints: " + ", ".join(f"{k['name']} {k['kind']} {k['bytes'] / GIB:.3f} GiB" for k in kinds))
    if full and delta:
        print(f"  first delta ({delta['steps']} steps after {full['name']}): {delta['bytes'] / 2**20:.0f} MiB, "
              f"{full['bytes'] / delta['bytes']:.1f}x smaller than the full one (goal >= 5x at 500 steps)")
    for name, p in sorted(procs.items()):
        steady = f", steady {p['steady_gib']:.2f}" if p["steady_gib"] else ""
        print(f"  {name}: peak RSS {p['peak_gib']:.2f} GiB{steady}")
    print(f"  goals: chief peak < 1 GiB; each ps steady <= 1.3 x {rows_state_gib:.2f} GiB (its rows and state), "
          "peak <= 1.2 x steady; workers < 1 GiB")
    print(f"resume: {resumed.get('status')}, {restore_s:.1f} s outside its training loop (restore, eval, model.pt); "
          f"the ps actors created and restored from the newest checkpoint's chains in {restore_parts_s} s"
          if restore_s is not None else f"resume failed: {log2[-2000:]}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
