"""The telemetry in ``dtrain report`` (docs/observability.md): panels and text from ``summary.json``.

``replicas_stats`` (each replica's time split into compute, data and ps), ``shards_stats`` (each ps
shard's load, and the async staleness histogram) and ``diagnosis`` (the findings). Any of them may
be missing (a run from before the telemetry, ``observe.telemetry: false``, a sync run without
staleness): a panel or a table appears only when its figures exist, and a malformed value (not a
dict, not a finite number, a histogram whose buckets do not match) is skipped, never an error.
"""

from __future__ import annotations

import math
from typing import Any

from dtrain.observe.style import BUSY, BYTES, PHASE_COLORS, SHARD_LOAD, STALE, STALENESS, TIME_PER_REPLICA

PHASES = ("compute", "data", "ps")
PANEL_WIDTH = 4.3  # inches per panel in the telemetry row
Row = tuple[str, dict[str, Any]]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _order(key: str) -> tuple[int, int, str]:
    try:
        return (0, int(key), "")
    except ValueError:
        return (1, 0, key)


def _items(summary: dict[str, Any] | None, key: str) -> list[Row]:
    """``summary[key]``'s entries that are dicts, as (index, figures), in index order."""
    stats = summary.get(key) if isinstance(summary, dict) else None
    if not isinstance(stats, dict):
        return []
    return sorted(((str(k), v) for k, v in stats.items() if isinstance(v, dict)), key=lambda kv: _order(kv[0]))


def replica_times(summary: dict[str, Any] | None) -> tuple[list[str], dict[str, list[float]], bool]:
    """(replica indexes, each phase's figure per replica, whether the figures are shares of the wall
    time): the shares when any replica has one, else the seconds. A missing phase counts 0; a
    replica with none of the three is left out."""
    rows = _items(summary, "replicas_stats")
    fracs = any(_number(s.get(f"{p}_frac")) is not None for _, s in rows for p in PHASES)
    suffix = "_frac" if fracs else "_s"
    labels: list[str] = []
    values: dict[str, list[float]] = {p: [] for p in PHASES}
    for idx, stats in rows:
        figures = [_number(stats.get(p + suffix)) for p in PHASES]
        if all(v is None for v in figures):
            continue
        labels.append(idx)
        for phase, v in zip(PHASES, figures, strict=True):
            values[phase].append(max(v or 0.0, 0.0))
    return labels, values, fracs


def shard_load(summary: dict[str, Any] | None) -> tuple[list[str], list[float | None], list[float | None]]:
    """(shard indexes, busy share per shard, MB in plus out per shard); a shard with neither is left out."""
    labels: list[str] = []
    busy: list[float | None] = []
    mb: list[float | None] = []
    for idx, stats in _items(summary, "shards_stats"):
        b = _number(stats.get("busy_frac"))
        io = [v for v in (_number(stats.get("bytes_in")), _number(stats.get("bytes_out"))) if v is not None]
        if b is None and not io:
            continue
        labels.append(idx)
        busy.append(b)
        mb.append(sum(io) / 1e6 if io else None)
    return labels, busy, mb


def bucket_labels(le: list[float]) -> list[str]:
    """Histogram bucket names from their upper bounds: ``[0, 1, 2, 4]`` -> ``0 1 2 3-4 >4``."""
    labels, low = [], 0
    for bound in le:
        up = int(bound)
        labels.append(str(up) if low >= up else f"{low}-{up}")
        low = up + 1
    return [*labels, f">{int(le[-1])}"]


def _histogram(stats: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    hist = stats.get("staleness")
    if not isinstance(hist, dict):
        return None
    le, counts = hist.get("le"), hist.get("counts")
    if not isinstance(le, list) or not isinstance(counts, list) or not le or len(counts) != len(le) + 1:
        return None
    bounds, numbers = [_number(x) for x in le], [_number(x) for x in counts]
    if any(b is None or not b.is_integer() or b < 0 for b in bounds) or any(c is None or c < 0 for c in numbers):
        return None
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):  # type: ignore[operator]
        return None
    return bounds, numbers  # type: ignore[return-value]


def staleness(summary: dict[str, Any] | None) -> tuple[list[str], list[float], float | None, float | None] | None:
    """(bucket names, counts summed over the shards, mean, max) of the async staleness histogram;
    None when no shard has one (a sync run) or no push was counted. A shard whose histogram is
    malformed, or whose buckets differ from the first shard's, is left out."""
    le: list[float] | None = None
    total: list[float] = []
    weighted = seen = 0.0
    worst: float | None = None
    for _, stats in _items(summary, "shards_stats"):
        hist = _histogram(stats)
        if hist is None or (le is not None and hist[0] != le):
            continue
        if le is None:
            le, total = hist[0], [0.0] * len(hist[1])
        total = [a + b for a, b in zip(total, hist[1], strict=True)]
        mean, top = _number(stats["staleness"].get("mean")), _number(stats["staleness"].get("max"))
        if mean is not None:
            weighted, seen = weighted + mean * sum(hist[1]), seen + sum(hist[1])
        if top is not None:
            worst = top if worst is None else max(worst, top)
    if le is None or not sum(total):
        return None
    return bucket_labels(le), total, (weighted / seen if seen else None), worst


def panels(summary: dict[str, Any] | None) -> list[str]:
    """The titles of the telemetry panels ``summary`` has figures for, in the order they are drawn."""
    found = []
    if replica_times(summary)[0]:
        found.append(TIME_PER_REPLICA)
    if shard_load(summary)[0]:
        found.append(SHARD_LOAD)
    if staleness(summary) is not None:
        found.append(STALENESS)
    return found


def row_height(summary: dict[str, Any] | None) -> float:
    """Inches for the telemetry row: taller with more replicas (one horizontal bar each), at most 12."""
    return min(max(3.8, 1.6 + 0.25 * len(replica_times(summary)[0])), 12.0)


def draw(fig: Any, summary: dict[str, Any] | None) -> list[Any]:
    """Draw the telemetry panels in a row on ``fig`` (a Figure or SubFigure); return their axes."""
    titles = panels(summary)
    if not titles:
        return []
    axes = list(fig.subplots(1, len(titles), squeeze=False)[0])
    for ax, title in zip(axes, titles, strict=True):
        {TIME_PER_REPLICA: _draw_times, SHARD_LOAD: _draw_shards, STALENESS: _draw_staleness}[title](ax, summary)
        ax.set_title(title)
    return axes


def _draw_times(ax: Any, summary: dict[str, Any] | None) -> None:
    labels, values, fracs = replica_times(summary)
    y = list(range(len(labels)))
    left = [0.0] * len(labels)
    for phase in PHASES:
        ax.barh(y, values[phase], left=left, color=PHASE_COLORS[phase], label=phase)
        left = [a + b for a, b in zip(left, values[phase], strict=True)]
    ax.set_yticks(y, labels=labels, fontsize="small" if len(labels) <= 24 else "x-small")
    ax.set_ylabel("replica")
    ax.set_ylim(len(labels) - 0.5, -0.5)  # replica 0 on top
    ax.set_xlabel("share of wall time" if fracs else "seconds")
    ax.set_xlim(0, max(max(left) * 1.45, 1.45 if fracs else 1e-9))  # room for the legend on the right
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(True, axis="x", alpha=0.3)


def _draw_shards(ax: Any, summary: dict[str, Any] | None) -> None:
    labels, busy, mb = shard_load(summary)
    x = list(range(len(labels)))
    has_busy, has_mb = any(b is not None for b in busy), any(m is not None for m in mb)
    width = 0.4 if has_busy and has_mb else 0.8
    handles, top = [], ax
    if has_busy:
        offset = [i - width / 2 for i in x] if has_mb else x
        heights = [100 * (b or 0.0) for b in busy]
        handles.append(ax.bar(offset, heights, width, color=BUSY, label="busy %"))
        ax.set_ylabel("busy %")
        ax.set_ylim(0, 1.25 * max(100.0, *heights))  # headroom for the legend
    if has_mb:
        top = ax.twinx() if has_busy else ax
        offset = [i + width / 2 for i in x] if has_busy else x
        heights = [m or 0.0 for m in mb]
        handles.append(top.bar(offset, heights, width, color=BYTES, label="MB in + out"))
        top.set_ylabel("MB in + out")
        top.set_ylim(0, 1.25 * max(heights) or 1.0)
    ax.set_xticks(x, labels=labels, rotation=90 if len(labels) > 16 else 0,
                  fontsize="small" if len(labels) <= 16 else "x-small")
    ax.set_xlabel("ps shard")
    top.legend(handles=handles, loc="upper center", ncols=2, fontsize="small")  # the twin axes draw on top


def _draw_staleness(ax: Any, summary: dict[str, Any] | None) -> None:
    found = staleness(summary)
    assert found is not None  # panels() listed it
    labels, counts, mean, worst = found
    ax.bar(range(len(labels)), counts, 0.8, color=STALE)
    ax.set_xticks(range(len(labels)), labels=labels, fontsize="small")
    ax.set_xlabel("global steps between pull and apply")
    ax.set_ylabel("pushes")
    ax.grid(True, axis="y", alpha=0.3)
    stats = [f"mean {mean:.2f}" if mean is not None else "", f"max {worst:.0f}" if worst is not None else ""]
    if any(stats):
        ax.text(0.97, 0.95, "\n".join(s for s in stats if s), ha="right", va="top", transform=ax.transAxes,
                fontsize="small")


def _pct(value: Any) -> str:
    v = _number(value)
    return "-" if v is None else f"{100 * v:.1f}"


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    v = _number(value)
    return "-" if v is None else format(v / scale, spec)


def _task(stats: dict[str, Any]) -> str:
    task = stats.get("task")
    return task if isinstance(task, str) and task else "-"


def _columns(head: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    """Left-aligned index and task columns (so no line starts with spaces and a number), numbers right."""
    task_w = max([len("task"), *(len(r[1]) for r in rows)]) + 2
    widths = [head[0][1], task_w, *(w for _, w in head[2:])]
    line = [f"{head[0][0]:<{widths[0]}}{'task':<{task_w}}" + "".join(f"{n:>{w}}" for (n, _), w in zip(head[2:], widths[2:], strict=True))]
    for r in rows:
        line.append(f"{r[0]:<{widths[0]}}{r[1]:<{task_w}}" + "".join(f"{c:>{w}}" for c, w in zip(r[2:], widths[2:], strict=True)))
    return line


def text(summary: dict[str, Any] | None) -> str:
    """The per-replica table, the per-shard table and the diagnosis, each when ``summary`` has it;
    ``""`` for a summary with none of them."""
    blocks = []
    replicas = _items(summary, "replicas_stats")
    if replicas:
        rows = [[idx, _task(s), _fmt(s.get("steps_per_s"), ".1f"), _pct(s.get("compute_frac")),
                 _pct(s.get("data_frac")), _pct(s.get("ps_frac"))] for idx, s in replicas]
        head = [("replica", 9), ("task", 0), ("steps/s", 9), ("compute %", 11), ("data %", 8), ("ps %", 8)]
        blocks.append("\n".join(_columns(head, rows)))
    shards = _items(summary, "shards_stats")
    if shards:
        rows = [[idx, _task(s), _pct(s.get("busy_frac")), _fmt(s.get("bytes_in"), ".2f", 1e6),
                 _fmt(s.get("bytes_out"), ".2f", 1e6), _fmt(s.get("dropped"), ".0f")] for idx, s in shards]
        head = [("shard", 7), ("task", 0), ("busy %", 8), ("MB in", 10), ("MB out", 10), ("dropped", 9)]
        blocks.append("\n".join(_columns(head, rows)))
    findings = summary.get("diagnosis") if isinstance(summary, dict) else None
    if isinstance(findings, list):
        lines = [" ".join(f.split()) for f in findings if isinstance(f, str) and f.strip()]
        if not findings:
            blocks.append("diagnosis: none")
        elif lines:
            blocks.append("\n".join(["diagnosis:", *(f"  {line}" for line in lines)]))
    return "\n\n".join(blocks)
