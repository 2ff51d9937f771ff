"""The main table: per-configuration summaries over the repetitions (ratios, step times, CPU,
memory) and their printing; the number formatting the scaling table shares."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from .configs import FIXED_COST_GOAL_MS, GOALS, Config, mlp_sizes
from .machine import LOOP


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt_num(x: float | None, spec: str = ",.0f", none: str = "–") -> str:
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def mb(x: float | None) -> str:
    return fmt_num(None if x is None else x / 1e6, ".2f" if x is not None and abs(x) < 10e6 else ".1f")


def summarize(configs: list[Config], runs: list[dict[str, Any]], reps: int) -> dict[str, dict[str, Any]]:
    """Per config: median samples/s, per-rep ratios to that rep's plain loop, step times, memory."""
    plain_by_rep = {r["rep"]: r for r in runs if r["config"] == "plain" and r.get("status") == "ok"}
    out: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        mine = [r for r in runs if r["config"] == cfg.name]
        ok = [r for r in mine if r.get("status") == "ok" and r.get("samples_per_sec")]
        ratios, fixed = [], []
        for r in ok:
            base = plain_by_rep.get(r["rep"])
            if base:
                ratios.append(r["samples_per_sec"] / base["samples_per_sec"])
                if r.get("step_ms") is not None and cfg.kind != "plain_x2":
                    fixed.append(r["step_ms"] - base["step_ms"])
        if len(ok) == len(mine) and ok:
            status = "ok"
        elif ok:
            status = f"partial ({len(mine) - len(ok)}/{len(mine)} reps failed)"
        else:
            status = "not available" if cfg.optional else "failed"
        entry: dict[str, Any] = {
            "label": cfg.label, "kind": cfg.kind, "status": status, "reps_ok": len(ok), "reps": len(mine),
            "samples_per_sec": median([r["samples_per_sec"] for r in ok]),
            "samples_per_sec_all": [r.get("samples_per_sec") for r in mine],
            "ratio": median(ratios), "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None, "ratios": ratios,
            "step_ms": median([r.get("step_ms") for r in ok]),
            "fixed_cost_ms": median(fixed) if cfg.kind != "plain" else 0.0,
            "config": asdict(cfg),
        }
        if cfg.name in GOALS:
            entry["goal_ratio"] = GOALS[cfg.name]
        errors = [r.get("error") for r in mine if r.get("status") != "ok" and r.get("error")]
        if errors:
            entry["error"] = errors[0]
        if cfg.kind == "dtrain":
            entry["method"] = sorted({r.get("method") for r in ok if r.get("method")})
            entry["memory"] = memory_summary(ok)
            entry["bytes_per_step_protocol"] = ok[0].get("bytes_per_step_protocol") if ok else None
            entry["lo_bytes_per_step"] = median([r.get("lo_bytes_per_step") for r in ok])
            entry["cpu_ms_per_replica_step"] = cpu_summary(ok)
        elif ok and ok[0].get("peak_rss"):
            entry["memory"] = {"process_peak_rss": median([r.get("peak_rss") for r in ok])}
        out[cfg.name] = entry
    return out


def cpu_summary(ok: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """Medians over repetitions: the ps tasks' CPU and a replica's own (mean of the worker tasks),
    in ms per replica step."""
    rows = [r["cpu_ms_per_replica_step"] for r in ok if r.get("cpu_ms_per_replica_step")]
    pushes = [r["cpu_ms_per_push"] for r in ok if r.get("cpu_ms_per_push")]
    if not rows:
        return None

    def values(row: dict[str, float], prefix: str, loop: bool = False) -> list[float]:
        return [v for n, v in row.items() if n.startswith(prefix) and n.endswith(LOOP) == loop]

    def mean(row: dict[str, float], prefix: str) -> float | None:
        xs = values(row, prefix)
        return sum(xs) / len(xs) if xs else None

    def total(row: dict[str, float], prefix: str, loop: bool = False) -> float | None:
        xs = values(row, prefix, loop)
        return sum(xs) if xs else None

    return {"ps_total": median([total(row, "ps-") for row in rows]),
            "ps_loop": median([total(row, "ps-", loop=True) for row in rows]),
            "replica_mean": median([mean(row, "worker-") for row in rows]),
            "chief": median([row.get("chief") for row in rows]),
            # per push (one applied gradient): the unit of issue 16's ps goal and of its floor, an
            # SGD apply plus one snapshot; equal to the above with one replica
            "ps_per_push": median([total(row, "ps-") for row in pushes]),
            "chief_per_push": median([row.get("chief") for row in pushes])}


def memory_summary(ok: list[dict[str, Any]]) -> dict[str, Any] | None:
    rows = [r for r in ok if r.get("memory")]
    if not rows:
        return None

    def med(role: str, key: str) -> float | None:
        vals = [v[key] for r in rows for n, v in r["memory"].items() if n.startswith(role)]
        return median(vals) if vals else None

    state = rows[0]["param_bytes"] + rows[0]["optimizer_state_bytes"]
    # Like for like: the ps's lifetime peak (ru_maxrss) against an idle worker's lifetime peak. A
    # worker's start-up already peaks ~70 MB above its settled RSS (imports), so comparing a peak
    # with a current RSS would charge that start-up transient to the ps's state.
    ps_idle, ps_peak = med("ps-", "idle_peak_rss"), med("ps-", "peak_rss")
    out = {
        "param_bytes": rows[0]["param_bytes"], "optimizer_state_bytes": rows[0]["optimizer_state_bytes"],
        "state_bytes": state, "ps_idle_rss": ps_idle, "ps_peak_rss": ps_peak,
        "ps_idle_current_rss": med("ps-", "idle_rss"), "ps_end_current_rss": med("ps-", "end_rss"),
        "replica_idle_rss": med("worker-", "idle_peak_rss"), "replica_peak_rss": med("worker-", "peak_rss"),
        "per_worker": rows[-1]["memory"],
    }
    kinds = {}
    for kind in ("RssAnon", "RssFile", "RssShmem"):
        vals = [v["end_status"][kind] - v["idle_status"][kind] for r in rows for n, v in r["memory"].items()
                if n.startswith("ps-") and kind in v.get("end_status", {}) and kind in v.get("idle_status", {})]
        if vals:
            kinds[kind] = median(vals)
    out["ps_settled_by_kind"] = kinds  # /proc's RssAnon, RssFile, RssShmem: after the run minus before
    if ps_idle is not None and ps_peak is not None and state:
        out["ps_excess_over_state"] = (ps_peak - ps_idle) / state
        out["ps_goal_bytes"] = 1.5 * state + ps_idle  # issue 7: ps peak <= 1.5 x state + idle worker (peak) RSS
        out["ps_goal_met"] = ps_peak <= out["ps_goal_bytes"]
    return out


# ------------------------------------------------------------------------------------ printing
def print_main(results: dict[str, dict[str, Any]], meta: dict[str, Any], tiny: bool) -> None:
    m = meta["settings"]
    mach = meta["machine"]
    sizes = "-".join(str(s) for s in mlp_sizes(m["model"]))
    print()
    print(f"dtrain benchmark: MLP {sizes} ({m['params']:,} parameters, {m['params'] * 4 / 1e6:.2f} MB fp32), "
          f"batch {m['batch']} per replica, {m['threads']} torch thread per process, {m['optimizer']['name']} "
          f"lr {m['optimizer']['lr']}")
    print(f"  {m['reps']} interleaved repetition(s); dtrain: {m['warmup']} warm-up + {m['steps']} timed global steps "
          f"(steady state from metrics.jsonl); plain/DDP: {m['plain_warmup']} warm-up + >= {m['steps']} steps")
    print(f"  machine: {mach.get('cpu_count')} CPUs ({mach.get('cpu_model', '?')}), torch {mach.get('torch')}, "
          f"dask {mach.get('dask')}, python {mach.get('python')}; load average at start "
          f"{mach.get('loadavg_start')}, at end {mach.get('loadavg_end')}")
    if (meta.get("link") or {}).get("header"):
        print(meta["link"]["header"])
    load = (mach.get("loadavg_start") or [0])[0]
    if mach.get("cpu_count") and load > 0.5 * mach["cpu_count"]:
        print("  NOTE: the machine was busy when the benchmark started; figures are noisy (see the ranges).")
    print()
    head = (f"{'config':<38} {'samples/s':>10}  {'ratio to plain (range)':<23} {'step ms':>8} {'fixed ms':>9}"
            f"  {'goal':<14} status")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        if r["ratio"] is not None:
            ratio = f"{r['ratio']:.2f}"
            if r["ratio_min"] is not None and len(r["ratios"]) > 1 and name != "plain":
                ratio += f" ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        else:
            ratio = "–"
        goal = ""
        if r.get("goal_ratio") is not None and not tiny:
            met = r["ratio"] is not None and r["ratio"] >= r["goal_ratio"]
            goal = f">= {r['goal_ratio']:.2f} {'met' if met else 'MISSED'}"
        if tiny and r["kind"] == "dtrain" and r["config"]["workers"] == 1 and r.get("fixed_cost_ms") is not None:
            met = r["fixed_cost_ms"] <= FIXED_COST_GOAL_MS
            goal = f"<= {FIXED_COST_GOAL_MS:g} ms {'met' if met else 'MISSED'}"
        fixed = "–" if r["kind"] in ("plain", "plain_x2") else fmt_num(r.get("fixed_cost_ms"), ".2f")
        step = fmt_num(r.get("step_ms"), ".2f")
        print(f"{r['label']:<38} {fmt_num(r['samples_per_sec']):>10}  {ratio:<23} {step:>8} {fixed:>9}  {goal:<14} "
              f"{r['status']}")
    for name, r in results.items():
        if r.get("error"):
            print(f"  {name}: {r['error']}")
    print()
    print("step ms: per-replica step time (replicas x batch / samples/s); fixed ms: step ms minus the plain loop's "
          "step ms in the same repetition (with 2 replicas on 2 cores it includes core sharing).")

    cpu_rows = [r for r in results.values() if r["kind"] == "dtrain" and r.get("cpu_ms_per_replica_step")]
    if cpu_rows:
        plain_ms = results.get("plain", {}).get("step_ms")
        print()
        ch = (f"{'CPU ms per replica step':<38} {'replica':>8} {'ps':>8} {'ps loop':>8} {'chief':>8} "
              f"{'ps/push':>8} {'chief/push':>10}")
        print(ch)
        print("-" * len(ch))
        for r in cpu_rows:
            c = r["cpu_ms_per_replica_step"]
            print(f"{r['label']:<38} {fmt_num(c['replica_mean'], '.2f'):>8} {fmt_num(c['ps_total'], '.2f'):>8} "
                  f"{fmt_num(c.get('ps_loop'), '.2f'):>8} {fmt_num(c.get('chief'), '.2f'):>8} "
                  f"{fmt_num(c.get('ps_per_push'), '.2f'):>8} {fmt_num(c.get('chief_per_push'), '.2f'):>10}")
        print("CPU (user + system) of each process over the timed window, per step of one replica (replica: the "
              "mean of the worker tasks; ps: all ps tasks together, of which ps loop: their Dask event loops, the "
              "rest being the data plane's connection threads; chief: the session with the embedded scheduler and "
              "nannies)" + (f"; the plain loop's whole step takes {plain_ms:.2f} ms" if plain_ms else "") +
              ". ps/push and chief/push: the same CPU per applied gradient; with N replicas a ps serves N pushes "
              "while one replica takes a step.")

    mem_rows = [(n, r) for n, r in results.items() if r["kind"] == "dtrain" and r.get("memory")]

    def settled(mm: dict[str, Any]) -> str:
        # The ps's current RSS after the run minus before it: its steady-state growth.
        end, idle = mm.get("ps_end_current_rss"), mm.get("ps_idle_current_rss")
        return "–" if end is None or idle is None else mb(end - idle)
    if mem_rows:
        print()
        mh = (f"{'memory (MB)':<38} {'state':>7} {'ps idle':>8} {'ps peak':>8} {'(peak-idle)/state':>18} "
              f"{'replica idle':>13} {'replica peak':>13} {'ps settled +':>13}  ps goal")
        print(mh)
        print("-" * len(mh))
        for _, r in mem_rows:
            mm = r["memory"]
            ex = mm.get("ps_excess_over_state")
            goal = "–" if "ps_goal_met" not in mm else ("met" if mm["ps_goal_met"] else "missed")
            print(f"{r['label']:<38} {mb(mm['state_bytes']):>7} {mb(mm['ps_idle_rss']):>8} {mb(mm['ps_peak_rss']):>8} "
                  f"{fmt_num(ex, '.2f'):>18} {mb(mm['replica_idle_rss']):>13} {mb(mm['replica_peak_rss']):>13} "
                  f"{settled(mm):>13}  {goal}")
        for _, r in mem_rows:
            k = r["memory"].get("ps_settled_by_kind") or {}
            if len(k) == 3:
                print(f"{r['label']}: ps settled + by kind: private {mb(k['RssAnon'])}, library pages "
                      f"{mb(k['RssFile'])}, shared memory {mb(k['RssShmem'])}")
        plain_mem = (results.get("plain", {}).get("memory") or {}).get("process_peak_rss")
        per_worker = mem_rows[0][1]["memory"].get("per_worker") or {}
        for role in ("ps-0", "worker-0"):
            pkgs = (per_worker.get(role) or {}).get("packages_loaded_by_run")
            if pkgs:
                print(f"{role} imported during the run (beyond the idle baseline): {', '.join(pkgs)}")
        print("state = parameters + optimizer state (bytes the ps must hold); idle = peak RSS (ru_maxrss) of the "
              "worker with torch and dtrain loaded, before the run (its start-up transient included, like the peak's); "
              "peak = ru_maxrss after the run; ps settled + = the ps's current RSS after the run minus before it; "
              "ps goal (issue 7): peak <= 1.5 x state + idle. By kind (/proc's RssAnon, RssFile, RssShmem): private "
              "memory (heap, tensors, stacks), pages of shared libraries first touched during the run (page cache "
              "shared with every process using them), and shared-memory files still mapped (the sync shard's "
              "parameters)." + (f" Plain PyTorch process peak RSS: {mb(plain_mem)} MB." if plain_mem else ""))

