"""The ``/dtrain`` page's Bokeh figures for one run, over data sources named per run and panel.

Each figure draws columns of the sources ``dtrain.observe.sources.run_sources`` builds; the
sources are named ``<run key>/<source>`` so the browser finds them when it replaces their columns
with ``/dtrain/live.json``'s (dtrain/observe/dashboard.py). Figures stretch to the page's width
(two per row), legends sit outside the plotting area so they never cover a bar or a line, axes
read in human units (``2.79 GiB``, ``1.25M``, ``3m20s``: formatted by bokehjs in the browser, so
the page needs nothing from outside the cluster), and colours and titles are ``dtrain report``'s
(dtrain/observe/style.py).
"""

from __future__ import annotations

import math
import threading
from typing import Any

from . import style

HEIGHT = 250
TIME_AXIS = "time since the run started"
TIME_TITLES = {"loss": "Loss", "steps": "Global steps per second", "samples": "Samples per second",
               "replica_ts": "Replica step rate over time", "shard_ts": "Per-shard busy share over time",
               "rows_ts": "Table rows over time", "memory_ts": "Memory per ps task over time"}
PRESENT_TITLES = {"shard_load": style.SHARD_LOAD, "shard_bytes": "Per-shard bytes",
                  "replica_time": style.TIME_PER_REPLICA, "replica_rate": "Replica step rate",
                  "staleness": style.STALENESS, "table_rows": "Table rows (all ps tasks)",
                  "table_bytes": "Table bytes (all ps tasks)", "memory": "Memory per task"}
_IN, _OUT = style.GRAY, "#c7c7c7"  # bytes in and out: report's grey, and a lighter one
_TABLE_BARS = (("live_rows", "live", style.CYAN), ("admitted", "admitted", style.GREEN),
               ("evicted", "evicted", style.OLIVE), ("rejected", "rejected", style.RED))

# The same units as dtrain.observe.history's human_bytes, human_count and human_duration.
_JS_BYTES = """
const u = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]; let v = Math.abs(x), i = 0;
if (!isFinite(x)) return "-";
while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
return (x < 0 ? "-" : "") + (i === 0 ? v.toFixed(0) : String(Number(v.toPrecision(3)))) + " " + u[i];"""
_JS_COUNT = """
const u = ["", "k", "M", "G", "T"]; let v = Math.abs(x), i = 0;
if (!isFinite(x)) return "-";
while (v >= 1000 && i < u.length - 1) { v /= 1000; i++; }
return (x < 0 ? "-" : "") + String(Number(v.toPrecision(3))) + u[i];"""
_JS_DURATION = """
if (!isFinite(x)) return "-";
if (Math.abs(x) < 60) return String(Number(x.toFixed(1))) + "s";
const s = Math.round(x), p = (n) => String(n).padStart(2, "0");
if (s >= 86400) return Math.floor(s / 86400) + "d" + p(Math.floor(s % 86400 / 3600)) + "h";
if (s >= 3600) return Math.floor(s / 3600) + "h" + p(Math.floor(s % 3600 / 60)) + "m";
if (s >= 60) return Math.floor(s / 60) + "m" + p(s % 60) + "s";
return s + "s";"""


# One formatter of each kind per run's figures (run_figures): Bokeh's drawing time grows with the
# models on the page, and one model may serve every axis of a document.
_shared = threading.local()


def _once(key: tuple[str, str], make: Any) -> Any:
    made = getattr(_shared, "models", None)
    if made is None:
        return make()
    if key not in made:
        made[key] = make()
    return made[key]


def _tick(code: str) -> Any:
    from bokeh.models import CustomJSTickFormatter

    return _once(("tick", code), lambda: CustomJSTickFormatter(code="const x = tick;" + code))


def _hover(code: str) -> Any:
    from bokeh.models import CustomJSHover

    return _once(("hover", code), lambda: CustomJSHover(code="const x = value;" + code))


def _figure(title: str, tooltips: list[tuple[str, str]] | None = None, **kwargs: Any) -> Any:
    from bokeh.plotting import figure

    fig = figure(title=title, height=HEIGHT, sizing_mode="stretch_width", toolbar_location="right",
                 tools="xpan,xwheel_zoom,reset", **kwargs)
    if tooltips:
        from bokeh.models import HoverTool

        fig.add_tools(HoverTool(tooltips=tooltips, formatters={"@t": _hover(_JS_DURATION)}))
    fig.xgrid.grid_line_color = None
    fig.title.text_font_size = "13px"  # type: ignore[union-attr]  # bokeh types the setter's str | None too
    fig.toolbar.logo = None
    fig.toolbar.active_scroll = None  # the page scrolls over a figure; a click on the tool zooms
    return fig


def _legend(fig: Any, items: list[tuple[str, Any]], place: str = "below") -> None:
    """A legend outside the plotting area (it never covers the data): below, in a row, or right."""
    from bokeh.models.annotations import Legend, LegendItem

    legend = Legend(items=[LegendItem(label=label, renderers=[r]) for label, r in items],
                    orientation="horizontal" if place == "below" else "vertical", label_text_font_size="11px",
                    spacing=4, padding=4, margin=4, click_policy="hide")  # type: ignore[arg-type]  # bokeh types padding as a Property
    fig.add_layout(legend, place)


def _source(key: str, name: str, columns: dict[str, list]) -> Any:
    from bokeh.models import ColumnDataSource

    return ColumnDataSource({k: v for k, v in columns.items() if k != "names"}, name=f"{key}/{name}")


# ---------------------------------------------------------------------- over time
def _time_figure(title: str, x_range: Any, marks: list[Any], y_format: str | None, tooltips: list, **kw: Any) -> Any:
    fig = _figure(title, tooltips=[("time", "@t{custom}"), *tooltips], x_range=x_range, **kw)
    fig.xaxis.formatter = _tick(_JS_DURATION)
    fig.xaxis.axis_label = TIME_AXIS
    if y_format is not None:
        fig.yaxis.formatter = _tick(y_format)
    for source, color, dash in marks:
        fig.vspan(x="t", source=source, line_color=color, line_dash=dash, line_width=1.5, line_alpha=0.8)
    return fig


def _time_figures(key: str, src: dict[str, dict[str, list]]) -> list[Any]:
    from bokeh.models import DataRange1d

    if "ts" not in src:
        return []
    x = DataRange1d(start=0)
    ts = _source(key, "ts", src["ts"])
    ckpt, recov = _source(key, "checkpoint", src["checkpoint"]), _source(key, "recovery", src["recovery"])
    marks = [(ckpt, style.CHECKPOINT, "dashed"), (recov, style.RECOVERY, "solid")]
    loss = _time_figure(TIME_TITLES["loss"], x, marks, None, [("step", "@step{0,0}"), ("loss", "@loss{0.0000}")])
    train = loss.line("t", "loss", source=ts, color=style.TRAIN_LOSS, line_width=2)
    ev = _source(key, "eval", src["eval"])
    loss.line("t", "loss", source=ev, color=style.EVAL_LOSS, line_dash="dashed")
    evals = loss.scatter("t", "loss", source=ev, color=style.EVAL_LOSS, size=7)
    checkpoints, recoveries = loss.renderers[:2]  # _time_figure drew the marks first
    _legend(loss, [("training loss", train), ("eval loss", evals), ("checkpoint", checkpoints),
                   ("recovery", recoveries)])
    loss.yaxis.axis_label = "loss"
    out = [loss]
    for name, column, label in (("steps", "steps_per_s", "global steps/s"), ("samples", "samples_per_s", "samples/s")):
        fig = _time_figure(TIME_TITLES[name], x, marks, _JS_COUNT, [("step", "@step{0,0}"), (label, f"@{column}{{0,0.0}}")])
        fig.line("t", column, source=ts, color=style.BLUE, line_width=2)
        fig.yaxis.axis_label = label
        fig.y_range.start = 0
        out.append(fig)
    for name, y_label, fmt in (("replica_ts", "steps per second", _JS_COUNT), ("shard_ts", "busy share", None),
                               ("rows_ts", "live rows", _JS_COUNT), ("memory_ts", "bytes in use", _JS_BYTES)):
        if name in src:
            out.append(_lines(key, name, src, x, marks, y_label, fmt))
    return out


def _lines(key: str, name: str, src: dict[str, dict[str, list]], x: Any, marks: list, y_label: str,
           fmt: str | None) -> Any:
    cols = src[name]
    source = _source(key, name, cols)
    summary = "low_who" in cols
    tips = [("lowest", "@low_who"), ("highest", "@high_who")] if summary else []
    fig = _time_figure(TIME_TITLES[name], x, marks, fmt, tips)
    items = []
    for i, label in enumerate(cols["names"]):
        r = fig.line("t", f"y{i}", source=source, color=style.TAB10[i % len(style.TAB10)], line_width=2)
        items.append((label.strip(), r))
    if name == "shard_ts":
        from bokeh.models import NumeralTickFormatter

        fig.yaxis.formatter = NumeralTickFormatter(format="0%")
    if name == "memory_ts" and "limits" in src:
        limit = fig.hspan(y="limit", source=_source(key, "limits", src["limits"]), line_color=style.RED,
                          line_dash="dashed", line_width=1.5)
        items.append(("memory limit", limit))
    _legend(fig, items, "right")
    fig.yaxis.axis_label = y_label
    fig.y_range.start = 0
    return fig


# ---------------------------------------------------------------------- the present
def _present_figures(key: str, src: dict[str, dict[str, list]]) -> list[Any]:
    from bokeh.models import NumeralTickFormatter
    from bokeh.transform import dodge

    out = []
    if "shards" in src:
        shards = _source(key, "shards", src["shards"])
        factors = list(src["shards"]["shard"])
        load = _figure(PRESENT_TITLES["shard_load"], x_range=factors, y_range=(0, 1),
                       tooltips=[("shard", "@shard @task"), ("busy", "@busy{0.0%}"),
                                 ("applies/s", "@applies_per_s{0,0.0}"), ("variables", "@variables")])
        load.vbar(x="shard", top="busy", width=0.8, source=shards, color=style.BUSY)
        load.xaxis.axis_label, load.yaxis.axis_label = "ps shard", "busy share"
        load.yaxis.formatter = NumeralTickFormatter(format="0%")
        volume = _figure(PRESENT_TITLES["shard_bytes"], x_range=factors,
                         tooltips=[("shard", "@shard @task"), ("bytes in", "@bytes_in{custom}"),
                                   ("bytes out", "@bytes_out{custom}")])
        volume.hover.formatters = {"@bytes_in": _hover(_JS_BYTES), "@bytes_out": _hover(_JS_BYTES)}
        bars = volume.vbar_stack(["bytes_in", "bytes_out"], x="shard", width=0.8, source=shards, color=[_IN, _OUT])
        _legend(volume, [("in (gradients)", bars[0]), ("out (parameters)", bars[1])])
        volume.xaxis.axis_label, volume.yaxis.axis_label = "ps shard", "bytes"
        volume.yaxis.formatter = _tick(_JS_BYTES)
        volume.y_range.start = 0
        out += [load, volume]
    if "replicas" in src:
        replicas = _source(key, "replicas", src["replicas"])
        factors = list(src["replicas"]["replica"])
        split = _figure(PRESENT_TITLES["replica_time"], y_range=list(reversed(factors)), x_range=(0, 1),
                        tooltips=[("replica", "@replica @task"), ("compute", "@compute_frac{0.0%}"),
                                  ("data", "@data_frac{0.0%}"), ("ps", "@ps_frac{0.0%}")])
        phases = list(style.PHASE_COLORS)
        bars = split.hbar_stack([f"{p}_frac" for p in phases], y="replica", height=0.8, source=replicas,
                                color=[style.PHASE_COLORS[p] for p in phases])
        _legend(split, list(zip(phases, bars, strict=True)))
        split.xaxis.axis_label, split.yaxis.axis_label = "share of wall time", "replica"
        split.xaxis.formatter = NumeralTickFormatter(format="0%")
        split.ygrid.grid_line_color = None
        rate = _figure(PRESENT_TITLES["replica_rate"], x_range=factors,
                       tooltips=[("replica", "@replica @task"), ("steps/s", "@steps_per_s{0,0.0}")])
        rate.vbar(x="replica", top="steps_per_s", width=0.8, source=replicas, color=style.BLUE)
        rate.xaxis.axis_label, rate.yaxis.axis_label = "replica", "steps per second"
        rate.yaxis.formatter = _tick(_JS_COUNT)
        rate.y_range.start = 0
        out += [split, rate]
    if "staleness" in src:
        fig = _figure(PRESENT_TITLES["staleness"], x_range=list(src["staleness"]["bucket"]),
                      tooltips=[("staleness", "@bucket"), ("pushes", "@count{0,0}"), ("mean loss", "@loss{0.0000}")])
        fig.vbar(x="bucket", top="count", width=0.8, color=style.STALE, source=_source(key, "staleness", src["staleness"]))
        fig.xaxis.axis_label, fig.yaxis.axis_label = "global steps between pull and apply", "pushes"
        fig.yaxis.formatter = _tick(_JS_COUNT)
        fig.y_range.start = 0
        out.append(fig)
    if "tables" in src:
        tables = _source(key, "tables", src["tables"])
        names = list(src["tables"]["table"])
        rows = _figure(PRESENT_TITLES["table_rows"], x_range=names,
                       tooltips=[("table", "@table"), ("live rows", "@live_rows{0,0}"), ("admitted", "@admitted{0,0}"),
                                 ("evicted", "@evicted{0,0}"), ("rejected", "@rejected{0,0}")])
        items = []
        for i, (column, label, color) in enumerate(_TABLE_BARS):
            r = rows.vbar(x=dodge("table", -0.3 + 0.2 * i, range=rows.x_range), top=column, width=0.18,
                          source=tables, color=color)
            items.append((label, r))
        _legend(rows, items)
        rows.yaxis.formatter = _tick(_JS_COUNT)
        rows.xaxis.axis_label, rows.yaxis.axis_label = "table", "rows"
        size = _figure(PRESENT_TITLES["table_bytes"], x_range=names,
                       tooltips=[("table", "@table"), ("bytes", "@bytes{custom}")])
        size.hover.formatters = {"@bytes": _hover(_JS_BYTES)}
        size.vbar(x="table", top="bytes", width=0.8, source=tables, color=style.CYAN)
        size.yaxis.formatter = _tick(_JS_BYTES)
        size.xaxis.axis_label, size.yaxis.axis_label = "table", "rows, optimizer state and index"
        for fig in (rows, size):
            fig.y_range.start = 0
            if len(names) > 6:
                fig.xaxis.major_label_orientation = math.pi / 3
        out += [rows, size]
    if "memory" in src:
        memory = _source(key, "memory", src["memory"])
        tasks = list(src["memory"]["who"])
        fig = _figure(PRESENT_TITLES["memory"], y_range=list(reversed(tasks)),
                      tooltips=[("task", "@task"), ("in use", "@used_h"), ("limit", "@limit_h")])
        used = fig.hbar(y="who", right="used", height=0.7, source=memory, color=style.BLUE)
        limit = fig.scatter(x="limit", y="who", source=memory, marker="dash", angle=math.pi / 2, size=22,
                            line_width=3, color=style.RED)
        _legend(fig, [("in use (RSS)", used), ("memory limit", limit)])
        fig.xaxis.formatter = _tick(_JS_BYTES)
        fig.xaxis.axis_label = "bytes"
        fig.x_range.start = 0
        fig.ygrid.grid_line_color = None
        out.append(fig)
    return out


def run_figures(key: str, src: dict[str, dict[str, list]]) -> list[Any]:
    """A run's figures (over time first, then the present), over sources named ``<key>/<source>``."""
    _shared.models = {}
    try:
        return _time_figures(key, src) + _present_figures(key, src)
    finally:
        _shared.models = None
