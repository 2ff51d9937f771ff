"""The ``/dtrain`` page's data for one run: the columns of each panel's data source.

Pure Python (no Bokeh): ``run_sources`` turns a run's latest payload and its history
(dtrain/observe/history.py) into the columns of every panel's data source, keyed by source;
dtrain/observe/figures.py draws the panels over sources holding those columns. The page embeds the figures once and the browser then replaces each
source's columns with the ones ``/dtrain/live.json`` serves (dtrain/observe/dashboard.py), so
the same function feeds the first drawing and every update; ``shape`` says what the figures were
drawn for (the sources' columns, the bars' categories): when it changes, the browser reloads the page.

Panels over time share one time axis (seconds since the run started, written ``3m20s``): the
loss (training, and evaluations as points), global steps and samples per second, each replica's
step rate and each shard's busy share (a line each up to ten, else the slowest, the median and
the fastest), the tables' live rows and the ps tasks' memory; checkpoints and recoveries are
vertical lines on each. Panels of the present: the per-shard load and bytes, the time per replica,
the step rates, the staleness histogram, the tables' rows and bytes, and memory per task against
its worker's limit.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from .history import human_bytes, table_name
from .meters import figure as _figure_of

MAX_LINES = 10  # one line per replica, shard or table up to this many (TAB10's colours), else a summary
_PHASES = ("compute", "data", "ps")
TABLE_FIGURES = ("live_rows", "bytes", "admitted", "evicted", "rejected")

def short_task(task: str) -> str:
    """``/job:ps/task:0`` -> ``ps 0``: a task as an axis label."""
    m = re.fullmatch(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+)", task)
    return f"{m.group(1)} {m.group(2)}" if m else task


def _num(value: Any) -> float:
    v = _figure_of(value)
    return math.nan if v is None else v


def _entries(payload: dict, section: str) -> list[tuple[str, dict]]:
    """A payload's replicas or shards in index order, entries that are not tables left out."""
    entries = payload.get(section)
    if not isinstance(entries, dict):
        return []
    items = [(str(k), v) for k, v in entries.items() if isinstance(v, dict)]
    return sorted(items, key=lambda kv: (0, int(kv[0]), "") if kv[0].isdigit() else (1, 0, kv[0]))


def _seq(value: Any) -> list | None:
    """A payload's list (a tuple once distributed's msgpack has carried it), or None."""
    return list(value) if isinstance(value, (list, tuple)) else None


def table_figures(payload: dict) -> dict[str, dict[str, float]]:
    """Per sparse table (``tables.C1.weight`` -> ``C1``), its figures summed over the shards that
    hold a part of it (:data:`TABLE_FIGURES`; a table with a vocabulary has rows and bytes only)."""
    out: dict[str, dict[str, float]] = {}
    for _, shard in _entries(payload, "shards"):
        tables = shard.get("tables")
        if not isinstance(tables, dict):
            continue
        for name, figures in tables.items():
            if not isinstance(figures, dict):
                continue
            entry = out.setdefault(table_name(name), {})
            for key in TABLE_FIGURES:
                if (v := _figure_of(figures.get(key))) is not None:
                    entry[key] = entry.get(key, 0.0) + v
    return out


def staleness_bars(payload: dict) -> tuple[list[str], list[float], list[float]] | None:
    """The staleness histogram summed over the shards that share the first shard's buckets:
    bucket labels, counts, and the mean loss per bucket (NaN where none was seen); None where no
    shard has one (a sync run)."""
    le: list | None = None
    counts: list[float] = []
    loss_sum: list[float] = []
    loss_n: list[float] = []
    for _, shard in _entries(payload, "shards"):
        stale = shard.get("staleness")
        if not isinstance(stale, dict):
            continue
        shard_counts = _seq(stale.get("counts"))
        if shard_counts is None:
            continue
        shard_le = _seq(stale.get("le")) or []
        if le is None:
            le = shard_le
            counts, loss_sum, loss_n = ([0.0] * len(shard_counts) for _ in range(3))
        if shard_le != le or len(shard_counts) != len(counts):
            continue
        losses = _seq(stale.get("loss")) or []
        for i, c in enumerate(shard_counts):
            n = 0.0 if math.isnan(_num(c)) else _num(c)
            counts[i] += n
            loss = _num(losses[i]) if i < len(losses) else math.nan
            if n > 0 and math.isfinite(loss):
                loss_sum[i] += loss * n
                loss_n[i] += n
    if le is None:
        return None
    labels = [f"≤{_num(b):g}" for b in le][:len(counts)]
    if len(counts) > len(labels):
        labels.append(f">{_num(le[-1]):g}" if le else "all")
    labels += [f"bucket {i}" for i in range(len(labels), len(counts))]
    return labels, counts, [s / n if n else math.nan for s, n in zip(loss_sum, loss_n, strict=True)]


# ---------------------------------------------------------------------- the sources' columns
def _lines(t: list[float], members: dict[str, list[float | None]], label: str) -> dict[str, list]:
    """Columns ``t``, ``y0``.. (a line per member) and ``names`` (their labels, not a column); past
    :data:`MAX_LINES` members, ``y0``.. are the lowest, the median and the highest at each time,
    with ``who`` naming the member of the lowest and of the highest."""
    out: dict[str, list] = {"t": t}
    if len(members) <= MAX_LINES:
        for i, col in enumerate(members.values()):
            out[f"y{i}"] = col
        out["names"] = [f"{label} {key}".strip() for key in members]
        return out
    keys = list(members)
    low: list[float | None] = []
    mid: list[float | None] = []
    high: list[float | None] = []
    low_who: list[str] = []
    high_who: list[str] = []
    for n in range(len(t)):
        seen = [(v, k) for k in keys if (v := members[k][n]) is not None]
        if not seen:
            low.append(None)
            mid.append(None)
            high.append(None)
            low_who.append("")
            high_who.append("")
            continue
        lo, hi = min(seen), max(seen)
        low.append(lo[0])
        high.append(hi[0])
        mid.append(statistics.median(v for v, _ in seen))
        low_who.append(f"{label} {lo[1]}")
        high_who.append(f"{label} {hi[1]}")
    out.update(y0=low, y1=mid, y2=high, low_who=low_who, high_who=high_who)
    out["names"] = [f"lowest {label}", f"median {label}", f"highest {label}"]
    return out


def run_sources(payload: dict, series: dict[str, Any] | None) -> dict[str, dict[str, list]]:
    """Every source's columns for one run: its latest ``payload`` and its ``series``
    (``RunHistory.series()``; None or empty for a run without one). A source whose figures the run
    lacks is left out (a sync run has no staleness, a dense model no tables)."""
    out: dict[str, dict[str, list]] = {}
    s = series or {}
    t = list(s.get("t") or [])
    if t:
        out["ts"] = {"t": t, **{k: list(s.get(k) or [None] * len(t))
                                for k in ("step", "loss", "steps_per_s", "samples_per_s")}}
        evals = s.get("evals") or []
        out["eval"] = {"t": [e["t"] for e in evals], "step": [e["step"] for e in evals],
                       "loss": [e["loss"] for e in evals]}
        for kind in ("checkpoint", "recovery"):
            marks = (s.get("marks") or {}).get(kind) or []
            out[kind] = {"t": [m["t"] for m in marks], "step": [m["step"] for m in marks]}
        groups = s.get("groups") or {}
        for group, label, source in (("replica", "replica", "replica_ts"), ("shard", "shard", "shard_ts"),
                                     ("rows", "table", "rows_ts")):
            members = groups.get(group) or {}
            if members:
                out[source] = _lines(t, dict(sorted(members.items(), key=lambda kv: _order(kv[0]))), label)
        memory = {k: v for k, v in (groups.get("memory") or {}).items() if k.startswith("/job:ps")}
        if memory:
            out["memory_ts"] = _lines(t, {short_task(k): v for k, v in sorted(memory.items())}, "")
            limits = s.get("limits") or {}
            out["limits"] = {"limit": sorted({limits[k] for k in memory if k in limits})}
    shards = _entries(payload, "shards")
    if shards:
        out["shards"] = {"shard": [k for k, _ in shards], "task": [str(v.get("task") or "") for _, v in shards],
                         "busy": [_num(v.get("busy_frac")) for _, v in shards],
                         "applies_per_s": [_num(v.get("applies_per_s")) for _, v in shards],
                         "bytes_in": [_zero(v.get("bytes_in")) for _, v in shards],
                         "bytes_out": [_zero(v.get("bytes_out")) for _, v in shards],
                         "variables": [", ".join(map(str, v.get("variables") or []))[:200] for _, v in shards]}
    replicas = _entries(payload, "replicas")
    if replicas:
        out["replicas"] = {"replica": [k for k, _ in replicas], "task": [str(v.get("task") or "") for _, v in replicas],
                           "steps_per_s": [_num(v.get("steps_per_s")) for _, v in replicas],
                           # a missing share stacks as nothing rather than hiding the bar
                           **{f"{p}_frac": [_zero(v.get(f"{p}_frac")) for _, v in replicas] for p in _PHASES}}
    bars = staleness_bars(payload)
    if bars is not None:
        out["staleness"] = {"bucket": bars[0], "count": bars[1], "loss": bars[2]}
    tables = table_figures(payload)
    if tables:
        names = list(tables)
        out["tables"] = {"table": names, **{k: [tables[n].get(k, math.nan) for n in names] for k in TABLE_FIGURES}}
    used, limits = s.get("memory") or {}, s.get("limits") or {}
    if used:
        tasks = sorted(used, key=lambda k: (not k.startswith("/job:ps"), k))
        out["memory"] = {"who": [short_task(k) for k in tasks], "task": tasks, "used": [used[k] for k in tasks],
                         "limit": [limits.get(k, math.nan) for k in tasks],
                         "used_h": [human_bytes(used[k]) for k in tasks],
                         "limit_h": [human_bytes(limits[k]) if k in limits else "no limit" for k in tasks]}
    return out


def _zero(value: Any) -> float:
    v = _num(value)
    return 0.0 if math.isnan(v) else v


def _order(key: str) -> tuple[int, int, str]:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


_FACTORS = {"shards": "shard", "replicas": "replica", "staleness": "bucket", "tables": "table", "memory": "who"}


def shape(sources: dict[str, dict[str, list]]) -> dict[str, Any]:
    """What the figures are drawn for: each source's columns, the bars' categories and the lines'
    names. Equal shapes: the page's figures take the new columns as they are."""
    out: dict[str, Any] = {}
    for name, cols in sources.items():
        entry: list[Any] = sorted(k for k in cols if k != "names")
        if name in _FACTORS:
            entry.append(list(cols[_FACTORS[name]]))
        if "names" in cols:
            entry.append(list(cols["names"]))
        out[name] = entry
    return out


def columns(sources: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    """The sources as the browser's data sources take them (the lines' names are labels, not columns)."""
    return {name: {k: v for k, v in cols.items() if k != "names"} for name, cols in sources.items()}
