"""The scaling sweep (``--scaling``): model size x ps shards against the plain loop, the raw
loopback round trip beside it, its table and its plot."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from .configs import LOOPBACK_EXTRA, SCALING_SHARDS, SCALING_STEPS, Config, param_count, progress
from .machine import loopback_rates
from .report import fmt_num, mb, median
from .runner import Runner


def run_scaling(runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    for rep in range(args.scaling_reps):
        for h in args.hidden:
            model = {"input": 784, "hidden": [h, h], "classes": 10}
            warmup, steps = SCALING_STEPS.get(h, (10, 40))
            every = 10
            plain_p = {**runner.base_params(model), "name": f"plain-h{h}", "warmup": 10, "steps": steps,
                       "min_seconds": 1.5}
            # The plain loop brackets the dtrain runs of this size (before and after; their mean is
            # the compute time subtracted), which halves the effect of a one-off slow measurement.
            before = runner.child("plain", plain_p)
            dtrain_points = []
            for shards in SCALING_SHARDS:
                cfg = Config(f"scale_h{h}_s{shards}", f"h{h} {shards} shard(s)", "dtrain", workers=1, ps=shards,
                             overlap=False, placement="partitioned" if shards > 1 else "round_robin")
                res = runner.measure(cfg, model, rep, warmup, steps, every)
                pt = {"rep": rep, "hidden": h, "shards": shards, "params": param_count(model),
                      "status": res.get("status"), "error": res.get("error"), "step_ms": res.get("step_ms"),
                      "samples_per_sec": res.get("samples_per_sec"), "shard_bytes": res.get("shard_bytes"),
                      "bytes_per_step": res.get("bytes_per_step_protocol"),
                      "lo_bytes_per_step": res.get("lo_bytes_per_step"),
                      "data_plane": ((res.get("summary") or {}).get("data_plane")),
                      "memory": res.get("memory")}
                dtrain_points.append(pt)
            after = runner.child("plain", plain_p)
            brackets = [r.get("step_ms") for r in (before, after) if r.get("status") == "ok"]
            plain_ms = statistics.mean(brackets) if brackets else None
            progress(f"[scaling rep {rep + 1}] hidden {h}: plain {fmt_num(plain_ms, '.2f')} ms/step "
                      f"(before {fmt_num(before.get('step_ms'), '.2f')}, after {fmt_num(after.get('step_ms'), '.2f')})")
            for pt in dtrain_points:
                pt["plain_step_ms"] = plain_ms
                pt["plain_step_ms_brackets"] = [before.get("step_ms"), after.get("step_ms")]
                if pt["step_ms"] and pt["plain_step_ms"] and pt["bytes_per_step"]:
                    exch = (pt["step_ms"] - pt["plain_step_ms"]) / 1e3
                    pt["exchange_ms"] = exch * 1e3
                    pt["exchange_gb_per_s"] = pt["bytes_per_step"] / exch / 1e9 if exch > 0 else None
                points.append(pt)
                progress(f"[scaling rep {rep + 1}] hidden {h}, {pt['shards']} shard(s): "
                          + (f"{pt['step_ms']:.2f} ms/step, {pt['bytes_per_step'] / 1e6:.1f} MB/step, exchange "
                             f"{fmt_num(pt.get('exchange_gb_per_s'), '.2f')} GB/s" if pt["status"] == "ok"
                             else f"FAILED: {pt['error']}"))
    # One buffer each way per round trip, as a shard exchange: the whole model (1 shard), the
    # largest of 2 shards, and the issue's 16 MiB shard.
    sizes = sorted({p["params"] * 4 for p in points}
                   | {max(p["shard_bytes"]) for p in points if p.get("shard_bytes")} | {LOOPBACK_EXTRA})
    loop = loopback_rates(sizes)
    progress("loopback TCP round trip: " + ", ".join(f"{x['bytes'] / 2**20:.1f} MiB {x['gb_per_s']:.2f} GB/s"
                                                      for x in loop))
    agg = aggregate_scaling(points)
    shared = {bool((p.get("data_plane") or {}).get("shared_memory_connections")) for p in points if p["status"] == "ok"}
    plane = {frozenset({True}): "shared memory", frozenset({False}): "socket bytes"}.get(frozenset(shared), "mixed")
    return {"points": points, "aggregated": agg, "loopback": loop, "data_plane": plane,
            "method": "dtrain async, 1 worker, overlap false; exchange = dtrain step - plain step; "
                      "bytes per step = 2 x parameter bytes (fp32 push + reply)"}


def aggregate_scaling(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in sorted({(p["hidden"], p["shards"]) for p in points}):
        ps = [p for p in points if (p["hidden"], p["shards"]) == key and p["status"] == "ok"]
        if not ps:
            out.append({"hidden": key[0], "shards": key[1], "status": "failed"})
            continue
        out.append({"hidden": key[0], "shards": key[1], "status": "ok", "params": ps[0]["params"],
                    "shard_bytes": ps[0]["shard_bytes"], "bytes_per_step": ps[0]["bytes_per_step"],
                    "step_ms": median([p["step_ms"] for p in ps]),
                    "plain_step_ms": median([p["plain_step_ms"] for p in ps]),
                    "exchange_ms": median([p.get("exchange_ms") for p in ps]),
                    "exchange_gb_per_s": median([p.get("exchange_gb_per_s") for p in ps]),
                    "lo_bytes_per_step": median([p.get("lo_bytes_per_step") for p in ps]),
                    "ps_peak_rss": median([(p.get("memory") or {}).get("ps-0", {}).get("peak_rss") for p in ps])})
    return out


def print_scaling(sc: dict[str, Any]) -> None:
    print()
    print("scaling: dtrain async, 1 worker, overlap false (exchange on the critical path), MLP 784-H-H-10, "
          f"batch per replica as above; data plane: {sc.get('data_plane', '?')}")
    head = (f"{'hidden':>6} {'shards':>6} {'params':>10} {'MB/step':>8} {'lo MB/step':>10} {'plain ms':>9} "
            f"{'dtrain ms':>10} {'exch ms':>8} {'exch GB/s':>10} {'largest shard MB':>17}")
    print(head)
    print("-" * len(head))
    for a in sc["aggregated"]:
        if a["status"] != "ok":
            print(f"{a['hidden']:>6} {a['shards']:>6}  failed")
            continue
        print(f"{a['hidden']:>6} {a['shards']:>6} {a['params']:>10,} {a['bytes_per_step'] / 1e6:>8.1f} "
              f"{mb(a['lo_bytes_per_step']):>10} {fmt_num(a['plain_step_ms'], '.2f'):>9} "
              f"{fmt_num(a['step_ms'], '.2f'):>10} {fmt_num(a['exchange_ms'], '.2f'):>8} "
              f"{fmt_num(a['exchange_gb_per_s'], '.2f'):>10} {max(a['shard_bytes']) / 1e6:>17.1f}")
    print("raw loopback TCP round trip (same run): " + ", ".join(
        f"{x['bytes'] / 1e6:.1f} MB {x['gb_per_s']:.2f} GB/s" for x in sc["loopback"]))
    print("MB/step: 2 x parameter bytes (protocol); lo MB/step: loopback interface counter, median over the summary "
          "intervals (machine-wide, a cross-check); plain ms: mean of a plain run before and after the dtrain runs; "
          "exch = dtrain step - plain step (GB/s '–' when not positive: noise); GB/s counts both directions.")


def plot_scaling(sc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = [a for a in sc["aggregated"] if a["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    hs = sorted({a["hidden"] for a in agg})
    plain = {a["hidden"]: a["plain_step_ms"] for a in agg}
    ax.plot(hs, [plain[h] for h in hs], "k--o", label="plain PyTorch")
    for s in SCALING_SHARDS:
        pts = [a for a in agg if a["shards"] == s]
        ax.plot([a["hidden"] for a in pts], [a["step_ms"] for a in pts], "-o", color=f"C{s - 1}",
                label=f"dtrain, {s} ps shard(s)")
    ax.set(xscale="log", yscale="log", xlabel="hidden width H (784-H-H-10)", ylabel="step time (ms)",
           title="step time vs model size")
    ax.legend()
    ax = axes[1]
    proto = {a["hidden"]: a["bytes_per_step"] for a in agg}
    ax.plot(hs, [proto[h] / 1e6 for h in hs], "k--o", label="protocol: 2 x parameter bytes (any shard count)")
    for s in SCALING_SHARDS:
        lo = [a for a in agg if a["shards"] == s and a.get("lo_bytes_per_step")]
        if lo:
            ax.plot([a["hidden"] for a in lo], [a["lo_bytes_per_step"] / 1e6 for a in lo], "x", color=f"C{s - 1}",
                    markersize=10, label=f"measured on loopback, {s} shard(s)")
    ax.set(xscale="log", yscale="log", xlabel="hidden width H", ylabel="MB moved per global step",
           title="bytes moved per step")
    ax.legend()
    ax = axes[2]
    loop = sc["loopback"]
    ax.plot([x["bytes"] * 2 / 1e6 for x in loop], [x["gb_per_s"] for x in loop], "k--o",
            label="raw loopback TCP round trip")
    for s in SCALING_SHARDS:
        pts = [a for a in agg if a["shards"] == s and a.get("exchange_gb_per_s")]
        ax.plot([a["bytes_per_step"] / 1e6 for a in pts], [a["exchange_gb_per_s"] for a in pts], "-o",
                color=f"C{s - 1}", label=f"dtrain exchange, {s} shard(s)")
    ax.set(xscale="log", xlabel="MB per round trip (both directions)", ylabel="GB/s",
           title="effective exchange rate")
    ax.set_ylim(bottom=0)
    ax.legend()
    from matplotlib.ticker import FormatStrFormatter, NullFormatter, NullLocator, ScalarFormatter

    for ax in axes[:2]:
        ax.set_xticks(hs)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        lo, hi = ax.get_ylim()
        # Label the minor ticks only when the axis spans less than a decade (else they crowd).
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g") if hi < 10 * lo else NullFormatter())
    fig.suptitle(f"dtrain scaling (async, 1 worker, overlap off; data plane: {sc.get('data_plane', '?')})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

