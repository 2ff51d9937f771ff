"""The ``/dtrain`` page on the Dask dashboard: where each run's time goes, drawn with Bokeh.

A static page rebuilt from the latest payloads and reloaded by the browser every two seconds,
not a Bokeh server app: it needs no session per viewer on the scheduler, no websocket, and it
shows the same figures as ``/metrics`` and ``/dtrain/data.json`` (docs/observability.md, "The
dashboard page"). Per run: the per-shard load (busy share, bytes), each replica's time split into
compute, data and ps, the replicas' step rates, the staleness histogram, the sparse tables' rows
(and evictions), and the findings.

Drawing takes a fraction of a second per run, and the handler runs on the scheduler's event
loop, so the drawing runs on one thread of its own (a page left open in several tabs costs the
scheduler at most that thread), is reused while the payloads have not changed, and covers the
newest ``PLOTTED_RUNS`` runs (the earlier ones get their figures in words). Bokehjs
comes from bokeh's own static files, served under ``STATIC_ROOT``, so the page works offline.
Every string from a payload is escaped: a run name or a finding is data from another process.
"""

from __future__ import annotations

import html
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tornado import web
from tornado.ioloop import IOLoop

from .meters import figure

logger = logging.getLogger(__name__)

STATIC_ROOT = "/dtrain/static/"
REFRESH_S = 2
EMPTY = "no dtrain run has reported yet"
PLOTTED_RUNS = 4  # the newest runs drawn; a page costs the scheduler a fraction of a second per run
EARLIER = "Plots are drawn for the newest runs only; /dtrain/data.json has every run's figures."

# Relative to the page at .../dtrain, so the page also loads behind a proxy that prefixes the
# dashboard's paths (jupyter-server-proxy's /proxy/8787/dtrain).
_ROOT_URL = "dtrain/"
_PHASES = [("compute_frac", "compute", "#1f77b4"), ("data_frac", "data", "#ff7f0e"), ("ps_frac", "ps", "#d62728")]
_HEIGHT, _WIDTH, _COLUMNS = 260, 460, 3

_executor: ThreadPoolExecutor | None = None
_render_lock = threading.Lock()  # guards _last (held while drawing: never taken on the event loop)
_pool_lock = threading.Lock()
_last: tuple[dict[str, dict], str] | None = None  # the payloads last drawn (held, so `is` is sound) and the page


def _num(value: Any, default: float = math.nan) -> float:
    v = figure(value)
    return default if v is None else v


def _seq(value: Any) -> list | None:
    """A payload's list (a tuple once distributed's msgpack has carried it), or None."""
    return list(value) if isinstance(value, (list, tuple)) else None


def _entries(payload: dict, section: str) -> list[tuple[str, dict]]:
    """A payload's replicas or shards in index order, entries that are not tables left out."""
    entries = payload.get(section)
    if not isinstance(entries, dict):
        return []
    items = [(str(k), v) for k, v in entries.items() if isinstance(v, dict)]
    return sorted(items, key=lambda kv: (0, int(kv[0]), "") if kv[0].isdigit() else (1, 0, kv[0]))


def _figure(title: str, **kwargs: Any) -> Any:
    from bokeh.plotting import figure

    fig = figure(title=title, height=_HEIGHT, width=_WIDTH, toolbar_location="right", tools="hover,save,reset",
                 **kwargs)
    fig.xgrid.grid_line_color = None
    return fig


def _shard_plots(payload: dict) -> list[Any]:
    from bokeh.models import ColumnDataSource

    shards = _entries(payload, "shards")
    if not shards:
        return []
    data = {"shard": [k for k, _ in shards],
            "task": [str(s.get("task") or "") for _, s in shards],
            "busy": [_num(s.get("busy_frac")) for _, s in shards],
            "applies_per_s": [_num(s.get("applies_per_s")) for _, s in shards],
            "bytes_in": [_num(s.get("bytes_in"), 0.0) for _, s in shards],
            "bytes_out": [_num(s.get("bytes_out"), 0.0) for _, s in shards],
            "variables": [", ".join(map(str, s.get("variables") or []))[:200] for _, s in shards]}
    source = ColumnDataSource(data)
    load = _figure("Per-shard load", x_range=data["shard"], y_range=(0, 1),
                   tooltips=[("shard", "@shard @task"), ("busy", "@busy{0.0%}"), ("applies/s", "@applies_per_s{0.0}"),
                             ("bytes in", "@bytes_in{0.0 b}"), ("bytes out", "@bytes_out{0.0 b}"),
                             ("variables", "@variables")])
    load.vbar(x="shard", top="busy", width=0.8, source=source, color="#2ca02c")
    load.xaxis.axis_label, load.yaxis.axis_label = "shard", "busy share"
    volume = _figure("Per-shard bytes", x_range=data["shard"],
                     tooltips=[("shard", "@shard @task"), ("bytes in", "@bytes_in{0.0 b}"),
                               ("bytes out", "@bytes_out{0.0 b}")])
    volume.vbar_stack(["bytes_in", "bytes_out"], x="shard", width=0.8, source=source, color=["#9467bd", "#8c564b"],
                      legend_label=["in (gradients)", "out (parameters)"])
    volume.xaxis.axis_label, volume.yaxis.axis_label = "shard", "bytes"
    volume.legend.location = "top_left"
    return [load, volume]


TABLE_FIGURES = ("live_rows", "bytes", "admitted", "evicted", "rejected")


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
            entry = out.setdefault(str(name).removeprefix("tables.").removesuffix(".weight"), {})
            for key in TABLE_FIGURES:
                if (v := figure(figures.get(key))) is not None:
                    entry[key] = entry.get(key, 0.0) + v
    return out


def _table_plots(payload: dict) -> list[Any]:
    """Rows per table (evicted ones beside them, for tables without a vocabulary)."""
    from bokeh.models import ColumnDataSource

    tables = table_figures(payload)
    if not tables:
        return []
    names = list(tables)
    data = {"table": names, **{k: [tables[n].get(k, 0.0) for n in names] for k in TABLE_FIGURES}}
    fig = _figure("Table rows (all ps tasks)", x_range=names,
                  tooltips=[("table", "@table"), ("rows", "@live_rows{0,0}"), ("bytes", "@bytes{0.0 b}"),
                            ("admitted", "@admitted{0,0}"), ("evicted", "@evicted{0,0}"),
                            ("rejected", "@rejected{0,0}")])
    fig.vbar_stack(["live_rows", "evicted"], x="table", width=0.8, source=ColumnDataSource(data),
                   color=["#17becf", "#bcbd22"], legend_label=["live rows", "evicted"])
    fig.xaxis.major_label_orientation = math.pi / 3
    fig.xaxis.axis_label, fig.yaxis.axis_label = "table", "rows"
    fig.legend.location = "top_left"
    return [fig]


def _replica_plots(payload: dict) -> list[Any]:
    from bokeh.models import ColumnDataSource

    replicas = _entries(payload, "replicas")
    if not replicas:
        return []
    data: dict[str, list] = {"replica": [k for k, _ in replicas],
                             "task": [str(r.get("task") or "") for _, r in replicas],
                             "steps_per_s": [_num(r.get("steps_per_s")) for _, r in replicas]}
    for key, _, _ in _PHASES:  # a missing share stacks as nothing rather than hiding the bar
        data[key] = [_num(r.get(key), 0.0) for _, r in replicas]
    source = ColumnDataSource(data)
    breakdown = _figure("Replica time breakdown", y_range=list(reversed(data["replica"])), x_range=(0, 1),
                        tooltips=[("replica", "@replica @task"), ("compute", "@compute_frac{0.0%}"),
                                  ("data", "@data_frac{0.0%}"), ("ps", "@ps_frac{0.0%}")])
    breakdown.hbar_stack([k for k, _, _ in _PHASES], y="replica", height=0.8, source=source,
                         color=[c for _, _, c in _PHASES], legend_label=[label for _, label, _ in _PHASES])
    breakdown.xaxis.axis_label, breakdown.yaxis.axis_label = "share of wall time", "replica"
    breakdown.ygrid.grid_line_color = None
    breakdown.legend.orientation, breakdown.legend.location = "horizontal", "bottom_right"
    rate = _figure("Replica step rate", x_range=data["replica"],
                   tooltips=[("replica", "@replica @task"), ("steps/s", "@steps_per_s{0.0}")])
    rate.vbar(x="replica", top="steps_per_s", width=0.8, source=source, color="#1f77b4")
    rate.xaxis.axis_label, rate.yaxis.axis_label = "replica", "steps per second"
    rate.y_range.start = 0
    return [breakdown, rate]


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
        shard_counts = _seq(stale.get("counts")) if isinstance(stale, dict) else None
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
            n = _num(c, 0.0)
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


def _staleness_plot(payload: dict) -> list[Any]:
    bars = staleness_bars(payload)
    if bars is None:
        return []
    from bokeh.models import ColumnDataSource

    labels, counts, loss = bars
    fig = _figure("Staleness", x_range=labels, tooltips=[("staleness", "@bucket"), ("pushes", "@count"),
                                                       ("mean loss", "@loss{0.0000}")])
    fig.vbar(x="bucket", top="count", width=0.8, color="#7f7f7f",
             source=ColumnDataSource({"bucket": labels, "count": counts, "loss": loss}))
    fig.xaxis.axis_label, fig.yaxis.axis_label = "global steps between pull and apply", "pushes"
    fig.y_range.start = 0
    return [fig]


def _header(run: str, payload: dict) -> str:
    facts = []
    step, steps = _num(payload.get("step")), _num(payload.get("steps"))
    if math.isfinite(step):
        facts.append(f"step {step:.0f}" + (f" / {steps:.0f}" if math.isfinite(steps) else ""))
    if not math.isnan(loss := _num(payload.get("loss"))):
        facts.append(f"loss {loss:.4g}")
    if math.isfinite(t := _num(payload.get("time"))):
        facts.append("updated " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)))
    return f"<h2>{html.escape(run)}</h2>\n<p>{html.escape('  ·  '.join(facts))}</p>"


def _findings(payload: dict) -> str:
    findings = _seq(payload.get("diagnosis"))
    if findings is None:
        return ""
    if not findings:
        return "<p>findings: none</p>"
    items = "".join(f"<li>{html.escape(str(f))}</li>" for f in findings)
    return f'<h3>Findings</h3>\n<ul class="findings">{items}</ul>'


def _page(body: str, head: str = "") -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="refresh" content="{REFRESH_S}">\n<title>dtrain</title>\n'
            f"<style>body{{font-family:sans-serif;margin:1em 2em}}</style>\n"
            f"{head}</head>\n<body>\n<h1>dtrain</h1>\n{body}\n</body>\n</html>\n")


def render_page(payloads: dict[str, dict]) -> str:
    """The whole page for ``{run: latest payload}``, the newest run first."""
    from bokeh.embed import components
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.layouts import gridplot
    from bokeh.resources import Resources

    runs = sorted(((str(r), p) for r, p in payloads.items() if isinstance(p, dict)),
                  key=lambda rp: -_num(rp[1].get("time"), -math.inf))
    if not runs:
        return _page(f"<p>{html.escape(EMPTY)}</p>")
    sections: list[tuple[str, str, list[Any]]] = []
    for n, (run, payload) in enumerate(runs):
        if n == PLOTTED_RUNS:
            sections.append(("<h2>Earlier runs</h2>", f"<p>{html.escape(EARLIER)}</p>", []))
        try:
            figs = _shard_plots(payload) + _replica_plots(payload) + _staleness_plot(payload) \
                + _table_plots(payload) if n < PLOTTED_RUNS else []
            sections.append((_header(run, payload), _findings(payload), figs))
        except Exception as exc:  # one run's malformed payload never blanks the others
            logger.debug("dtrain dashboard: skipping run %r (%s: %s)", run, type(exc).__name__, exc)
            sections.append((_header(run, {}), f"<p>{html.escape(f'malformed telemetry: {exc}')}</p>", []))
    # One root per run (a grid of its plots): Bokeh recomputes the document's models on every root
    # it adds, so a root per plot makes the drawing quadratic in the plots.
    roots = [gridplot(run_figs, ncols=_COLUMNS, merge_tools=False) if run_figs else None
             for _, _, run_figs in sections]
    drawn = [r for r in roots if r is not None]
    if not drawn:
        return _page("\n".join(h + "\n" + f for h, f, _ in sections))
    script, divs = components(drawn)
    bundle = bundle_for_objs_and_resources(drawn, Resources(mode="server", root_url=_ROOT_URL))
    head = "".join(f'<script src="{html.escape(str(u.url))}"></script>\n' for u in bundle.js_files) + script + "\n"
    body, placed = [], iter(divs)
    for (header, findings, _), root in zip(sections, roots, strict=True):
        body.append(header + "\n" + (next(placed) if root is not None else "") + "\n" + findings)
    return _page("\n".join(body), head)


def _render_cached(payloads: dict[str, dict]) -> str:
    """``render_page``, reused while every run's payload is the same object (the plugin replaces
    a payload, never edits one)."""
    global _last
    with _render_lock:
        if _last is not None and _last[0].keys() == payloads.keys() \
                and all(_last[0][r] is p for r, p in payloads.items()):
            return _last[1]
        page = render_page(payloads)
        _last = (dict(payloads), page)
        return page


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _pool_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-dashboard")
        return _executor


class PageHandler(web.RequestHandler):
    """``/dtrain``: the page for the runs ``source()`` returns (``{run: latest payload}``)."""

    def initialize(self, source: Callable[[], dict[str, dict]]) -> None:
        self._source = source

    async def get(self) -> None:
        try:
            page = await IOLoop.current().run_in_executor(_pool(), _render_cached, dict(self._source()))
        except Exception as exc:  # the viewer sees why; the scheduler's log is not spammed every refresh
            logger.debug("dtrain dashboard: drawing the page failed", exc_info=True)
            page = _page(f"<p>{html.escape(f'the page could not be drawn: {type(exc).__name__}: {exc}')}</p>")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(page)
