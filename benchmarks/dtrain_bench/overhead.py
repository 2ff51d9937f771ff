"""``bench.py --observe``: what the telemetry costs.

Two measures. End to end: each main configuration with ``observe.telemetry`` on and off, back to
back in every repetition (their order swapped every other repetition), compared per repetition.
On a shared 2-core machine the runs of one configuration vary by more than the telemetry could
cost, so the second measure bounds it directly: a ``ParameterShard``'s ``push_pull`` on the
benchmark model's shard, in this process (no Dask, no socket), with its meter on and off,
alternated, best of several rounds: the ps's own cost per push, where the meter sits (a replica's
share is two clock reads and four additions per step).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .configs import param_count


def pair_order(configs: list[Any], rep: int, alternate: bool) -> list[Any]:
    """The configurations of repetition ``rep``; with ``alternate`` (``--observe``) each on/off pair
    swaps its order every other repetition, so running first or second favours neither."""
    if not alternate or rep % 2 == 0:
        return configs
    out = list(configs)
    for i, cfg in enumerate(out):
        if cfg.name.endswith("_notelemetry") and i > 0 and out[i - 1].name == cfg.name.removesuffix("_notelemetry"):
            out[i - 1], out[i] = out[i], out[i - 1]
    return out


def print_overhead(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Telemetry's cost: per repetition, samples/s with it on over samples/s with it off (the two
    run back to back); the median and range of (on / off - 1)."""
    out: dict[str, Any] = {}
    ok = {(r["config"], r["rep"]): r["samples_per_sec"] for r in runs if r.get("status") == "ok"}
    print("\ntelemetry overhead (samples/s with observe.telemetry on vs off, same repetition):")
    for name in sorted({c for c, _ in ok if c.endswith("_notelemetry")}):
        on_name = name.removesuffix("_notelemetry")
        costs = sorted(1 - ok[(on_name, rep)] / ok[(name, rep)] for c, rep in ok if c == name and (on_name, rep) in ok)
        if costs:
            median = statistics.median(costs)
            out[on_name] = {"median": median, "min": costs[0], "max": costs[-1], "reps": len(costs)}
            print(f"  {on_name:<16} {median:+7.1%}  (range {costs[0]:+.1%} .. {costs[-1]:+.1%}, {len(costs)} reps)")
    return out


def ps_cost(params: int, calls: int = 300, rounds: int = 7) -> dict[str, float]:
    """Microseconds per ``push_pull`` of a ``params``-sized shard (SGD), telemetry on and off."""
    import asyncio

    import torch

    from dtrain.ps.shard import ParameterShard

    torch.set_num_threads(1)
    config = {"index": 0, "mode": "async", "steps": 1 << 60, "optimizer": {"name": "sgd", "lr": 0.01},
              "summary_every": 1 << 30}
    shards = {on: ParameterShard({**config, "telemetry": on}, torch.zeros(params)) for on in (True, False)}
    grad = torch.full((params,), 1e-6)
    out = torch.empty(params)

    async def timed(shard: Any) -> float:
        t0 = time.perf_counter()
        for i in range(calls):
            await shard.push_pull(grad, 0, shard.step, 0.5, 128, i, out=out)
        return (time.perf_counter() - t0) / calls * 1e6

    best = {True: float("inf"), False: float("inf")}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            best[on] = min(best[on], asyncio.run(timed(shards[on])))
    return {"on_us": best[True], "off_us": best[False], "cost_us": best[True] - best[False]}


def print_ps_cost(model: dict[str, Any]) -> dict[str, float]:
    res = ps_cost(param_count(model))
    print(f"ps push_pull, {param_count(model):,} parameters, in-process: {res['on_us']:.1f} us with telemetry, "
          f"{res['off_us']:.1f} us without: {res['cost_us']:+.1f} us per push "
          f"({res['cost_us'] / res['off_us']:+.2%} of the ps's work per push)")
    return res
