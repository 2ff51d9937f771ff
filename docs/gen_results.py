"""The latest-results tables of the docs, generated from the benchmarks' own outputs
(``benchmarks/results/*.json``, written by each benchmark run) between the markers
``<!-- results:NAME -->`` and ``<!-- /results -->`` in ``docs/performance.md`` and
``docs/lab.md`` (``PAGES``).

    python docs/gen_results.py           # rewrite the tables
    python docs/gen_results.py --check   # exit 1 when a table differs from its JSON (make docs, CI)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "docs" / "performance.md", ROOT / "docs" / "lab.md"]
GIB = 2**30


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table_scale(r: dict[str, Any]) -> list[str]:
    """``benchmarks/table_scale.py``: training, checkpoints (full and incremental), memory, resume."""
    kinds = r.get("incremental") or []
    full = next((k for k in kinds if k["kind"] == "full"), None)
    delta = next((k for k in kinds if k["kind"] == "delta" and (k.get("steps") or 0) >= 400), None)
    held = [w["held_s"] for w in r["checkpoints"]]
    procs = r["processes"]
    ps = [p for name, p in procs.items() if name.startswith("/job:ps/") and "writer" not in name]
    workers = [p for name, p in procs.items() if name.startswith("/job:worker/")]
    chief = next(p for name, p in procs.items() if name.startswith("chief"))
    share = 100 * (sum(held) / len(held)) / (500 * r["step_s"]) if held else None
    rows = [
        ("training", f"{r['samples_per_s']:,.0f} samples/s, {1000 * r['step_s']:.0f} ms per step "
                     f"({r['global_step']} steps)", ""),
        ("full checkpoint", f"{full['bytes'] / GIB:.2f} GiB" if full else "-", ""),
        ("delta after ~500 steps", f"{delta['bytes'] / 2**20:.0f} MiB after {delta['steps']} steps, "
                                    f"{full['bytes'] / delta['bytes']:.0f}x smaller" if full and delta else "-",
         ">= 5x smaller"),
        ("written in the background", ", ".join(f"{w['write_s']:.1f} s" for w in r["checkpoints"]), ""),
        ("training held per checkpoint", ", ".join(f"{h:.3f} s" for h in held)
         + (f" ({max(held) / (full['bytes'] / GIB):.3f} s per GiB of tables)" if full and held else ""),
         "< 1 s per GiB snapshotted"),
        ("held over a 500-step interval", f"{share:.2f}% of the step time" if share is not None else "-", "< 2%"),
        ("chief peak RSS", f"{chief['peak_gib']:.2f} GiB", "< 1 GiB"),
        ("each ps: steady / peak RSS", ", ".join(f"{p['steady_gib']:.2f} / {p['peak_gib']:.2f} GiB" for p in ps),
         "peak <= 1.2x steady"),
        ("each worker: peak RSS", ", ".join(f"{p['peak_gib']:.2f} GiB" for p in workers), "< 1 GiB"),
        ("restore of the newest checkpoint (its chains, on the ps tasks)",
         f"{r['restore_s']:.1f} s" if r.get("restore_s") is not None else "-", ""),
        ("resume outside training (restore, evaluation, model.pt)", f"{r['resume_to_end_s']:.1f} s, "
         f"{r['resume_status']}" if r.get("resume_to_end_s") is not None else "-", ""),
    ]
    head = [f"`python benchmarks/table_scale.py --rows {r['rows']} --every {r['every_steps']}` "
            "(`pipelines/dlrm_criteo_1tb.yaml`: 26 tables, 187.8M rows in bfloat16 on 2 ps tasks):", "",
            "| measure | result | goal |", "| --- | --- | --- |"]
    return head + [f"| {a} | {b} | {c} |" for a, b, c in rows]


def rec_bench(r: dict[str, Any]) -> list[str]:
    """``benchmarks/rec_bench.py``: DLRM on Criteo-layout data, dtrain against TorchRec and torch."""
    s = r["settings"]
    head = [f"`python benchmarks/rec_bench.py --rows {s['rows']} --files {s['files']} --scale {s['scale']} "
            f"--cap {s['cap']} --reps {s['reps']}` (the same model, data, batch and learning rate; each repetition "
            "from its own seed, medians):", "",
            "| row | samples/s | ratio to TorchRec (range) | eval log loss | vs TorchRec, same seed | eval AUC |",
            "| --- | --- | --- | --- | --- | --- |"]
    out = []
    for name, row in r["results"].items():
        if row.get("status") != "ok":
            out.append(f"| {name} | {row.get('status')} | | | | |")
            continue
        lo, hi = row["ratio_range"]
        gap = row.get("logloss_vs_torchrec")
        out.append(f"| {name} | {row['samples_per_s']:,.0f} | {row['ratio_to_torchrec']:.2f} ({lo:.2f}-{hi:.2f}) | "
                   f"{row['eval_logloss']:.4f} | {'-' if gap is None else f'{gap:+.4f}'} | {row['eval_auc']:.4f} |")
    return head + out


GROWS = ("ps_cpu_per_push_ms", "chief_cpu_per_s", "scheduler_cpu_per_s")


def lab_scaling_rows(r: dict[str, Any]) -> list[str]:
    """``benchmarks/lab_scaling.py``'s table (the benchmark prints it too)."""
    lines = ["| mode | replicas | global steps/s | ps CPU per push (ms) | chief CPU/s | scheduler CPU/s (idle) | "
             "workers CPU/s | growth over 1 replica: ps per push, chief, scheduler |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in sorted(r["results"], key=lambda x: (x["mode"], x["replicas"])):
        if row["status"] != "ok":
            lines.append(f"| {row['mode']} | {row['replicas']} | failed | | | | | |")
            continue
        g = row.get("growth") or {}
        growth = ", ".join("-" if g.get(k) is None else f"{g[k]:.2f}x" for k in GROWS)
        idle = row.get("idle_scheduler_cpu_per_s")
        lines.append(f"| {row['mode']} | {row['replicas']} | {row['steps_per_s']:,.1f} | "
                     f"{row['ps_cpu_per_push_ms']:.3f} | {row['chief_cpu_per_s']:.3f} | "
                     f"{row['scheduler_cpu_per_s']:.3f}{f' ({idle:.3f})' if idle is not None else ''} | "
                     f"{row['workers_cpu_per_s']:.2f} | {growth} (replicas {row.get('replica_growth', 1):g}x) |")
    return lines


def lab_scaling(r: dict[str, Any]) -> list[str]:
    """``benchmarks/lab_scaling.py``: fixed costs against the replica count, across the lab."""
    s = r["settings"]
    head = [f"`python benchmarks/lab_scaling.py --replicas {','.join(map(str, s['replicas']))} --modes "
            f"{','.join(s['modes'])} --window {s['window_s']:g}` ({s['spread']}; links {s['rate']}; batch "
            f"{s['batch']}):", ""]
    return head + lab_scaling_rows(r)


TABLES: dict[str, Callable[[dict[str, Any]], list[str]]] = {"table_scale": table_scale, "rec_bench": rec_bench,
                                                            "lab_scaling": lab_scaling}
MARK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results -->)", re.S)


def render(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        data = _load(m.group(2))
        body = "\n".join(TABLES[m.group(2)](data)) if data is not None else f"(no benchmarks/results/{m.group(2)}.json)"
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return MARK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when the page differs from the results")
    args = ap.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        if new == text:
            continue
        if args.check:
            stale.append(page)
        else:
            page.write_text(new)
            print(f"wrote {page}")
    for page in stale:
        print(f"{page} is not what docs/gen_results.py writes from benchmarks/results/: run it", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
