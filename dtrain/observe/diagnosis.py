"""Findings: stragglers, hot shards, input-bound replicas and harmful staleness, from the figures.

A pure function of the per-replica and per-shard figures (the keys of docs/observability.md)
and the ``observe:`` thresholds, so the rules are tested without a cluster. Each finding is one
line that names the replica or ps task, the measured figure and the threshold it crossed.
"""

from __future__ import annotations

import statistics
from typing import Any

from .meters import figure as _num

MIN_STEPS = 5  # fewer local steps than this: too early to judge a replica
MIN_PUSHES = 5


def _who(kind: str, index: str, item: dict[str, Any]) -> str:
    task = item.get("task")
    return f"{kind} {index} ({task})" if task else f"{kind} {index}"


def stragglers(replicas: dict[str, dict[str, Any]], ratio: float) -> list[str]:
    rates = {i: r for i, rep in replicas.items()
             if (r := _num(rep.get("steps_per_s"))) is not None and (_num(rep.get("steps")) or 0) >= MIN_STEPS}
    if len(rates) < 2:
        return []
    median = statistics.median(rates.values())
    return [f"straggler: {_who('replica', i, replicas[i])} ran {r:.1f} steps/s, below {ratio:g} of the median "
            f"replica's {median:.1f}" for i, r in rates.items() if r < ratio * median]


def input_bound(replicas: dict[str, dict[str, Any]], share: float) -> list[str]:
    out = []
    for i, rep in replicas.items():
        frac = _num(rep.get("data_frac"))
        if frac is not None and frac > share and (_num(rep.get("steps")) or 0) >= MIN_STEPS:
            out.append(f"input-bound: {_who('replica', i, rep)} waited for data {frac:.0%} of its time "
                       f"(threshold {share:.0%}); more data.readers or data.prefetch, or faster storage")
    return out


def hot_shards(shards: dict[str, dict[str, Any]], busy: float, bytes_ratio: float) -> list[str]:
    out = []
    moved = {j: (_num(s.get("bytes_in")) or 0) + (_num(s.get("bytes_out")) or 0) for j, s in shards.items()}
    mean = sum(moved.values()) / len(moved) if moved else 0.0
    for j, sh in shards.items():
        reasons = []
        frac = _num(sh.get("busy_frac"))
        if frac is not None and frac > busy and (_num(sh.get("pushes")) or 0) >= MIN_PUSHES:
            reasons.append(f"busy {frac:.0%} of the time (threshold {busy:.0%})")
        if len(moved) >= 3 and mean > 0 and moved[j] > bytes_ratio * mean:
            reasons.append(f"moved {moved[j] / mean:.1f}x the mean bytes per shard (threshold {bytes_ratio:g}x)")
        if reasons:
            held = sh.get("variables") or []
            holds = f"; it holds {', '.join(map(str, held[:8]))}{' ...' if len(held) > 8 else ''}" if held else ""
            out.append(f"hot shard: {_who('shard', j, sh)} {' and '.join(reasons)}{holds}")
    return out


def staleness(shards: dict[str, dict[str, Any]], limit: float) -> list[str]:
    """Async: the shards' mean staleness over ``limit``, with the loss of the stalest pushes
    against the freshest when both were seen (the cost staleness has on the loss)."""
    counts: list[float] = []
    loss_sum: list[float] = []
    loss_n: list[float] = []
    total = weighted = 0.0
    le: list[int] = []
    for sh in shards.values():
        st = sh.get("staleness")
        if not isinstance(st, dict) or not isinstance(st.get("counts"), list):
            continue
        le = list(st.get("le") or le)
        c = [_num(x) or 0.0 for x in st["counts"]]
        raw_losses = st.get("loss")
        losses: list[Any] = raw_losses if isinstance(raw_losses, list) else [None] * len(c)
        if len(counts) < len(c):
            counts += [0.0] * (len(c) - len(counts))
            loss_sum += [0.0] * (len(c) - len(loss_sum))
            loss_n += [0.0] * (len(c) - len(loss_n))
        for b, n in enumerate(c):
            counts[b] += n
            if b < len(losses) and (lv := _num(losses[b])) is not None and n:
                loss_sum[b] += lv * n
                loss_n[b] += n
        if (m := _num(st.get("mean"))) is not None:
            total += sum(c)
            weighted += m * sum(c)
    if not total or total < MIN_PUSHES:
        return []
    mean = weighted / total
    if mean <= limit:
        return []
    line = f"staleness: pushes were {mean:.1f} global steps stale on average (threshold {limit:g})"
    seen = [b for b in range(len(loss_n)) if loss_n[b]]
    if len(seen) >= 2:
        fresh, stale = seen[0], seen[-1]
        def label(b: int) -> str:
            return f"<= {le[b]}" if b < len(le) else f"> {le[-1]}"
        line += (f"; loss {loss_sum[stale] / loss_n[stale]:.4f} at staleness {label(stale)} against "
                 f"{loss_sum[fresh] / loss_n[fresh]:.4f} at {label(fresh)}")
    return [line + "; consider sync mode or training.max_staleness"]


def diagnose(replicas: dict[str, dict[str, Any]], shards: dict[str, dict[str, Any]], observe: Any,
             async_mode: bool, num_replicas: int) -> list[str]:
    """Every finding, in a stable order: stragglers, input-bound replicas, hot shards, staleness."""
    limit = observe.max_mean_staleness if observe.max_mean_staleness is not None else 2.0 * num_replicas
    return [*stragglers(replicas, observe.straggler_ratio), *input_bound(replicas, observe.input_bound),
            *hot_shards(shards, observe.hot_busy, observe.hot_bytes_ratio),
            *(staleness(shards, limit) if async_mode else [])]
