"""The ``/dtrain`` page on the Dask dashboard: how each run moves and where its time goes, with Bokeh.

A static page and a small JSON feed, not a Bokeh server app: no session per viewer on the
scheduler and no websocket. The page embeds each run's figures (dtrain/observe/figures.py) once;
its script then asks ``/dtrain/live.json`` every ``REFRESH_S`` seconds for every figure's columns
(dtrain/observe/sources.py), the runs' headers and findings, and replaces them in place (zoom and
hidden legend entries stay as the viewer left them). The feed says what the figures were drawn for
(its ``shape``: the runs, their sources' columns, the bars' categories); when that changes (a new
run, a replica joining, a first table row) the page reloads itself and gets new figures.

What that costs the scheduler (docs/observability.md, "The dashboard page"): drawing a run's
figures takes a second or so, so it runs on a thread of its own, only when that run's shape
changes (each run is a Bokeh document of its own, kept while its shape holds), and covers the
newest ``PLOTTED_RUNS`` runs (earlier runs get their figures in words).
The feed is built on the event loop from what the plugin holds, at most once per new payload,
and served from a cache in between. Bokehjs comes from bokeh's own static files under
``STATIC_ROOT``, so the page loads nothing from outside the cluster. Every string from a payload
is escaped: a run name or a finding is data from another process.
"""

from __future__ import annotations

import hashlib
import html
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tornado import web
from tornado.ioloop import IOLoop

from .history import human_count, jsonable
from .meters import figure
from .sources import columns, run_sources, shape, staleness_bars, table_figures

__all__ = ["EMPTY", "Run", "live", "render_page", "staleness_bars", "table_figures"]

logger = logging.getLogger(__name__)

STATIC_ROOT = "/dtrain/static/"
REFRESH_S = 2
EMPTY = "no dtrain run has reported yet"
PLOTTED_RUNS = 4  # the newest runs drawn; a page costs the scheduler a fraction of a second per run
EARLIER = "Plots are drawn for the newest runs only; /dtrain/data.json has every run's figures."

# Relative to the page at .../dtrain, so the page also loads behind a proxy that prefixes the
# dashboard's paths (jupyter-server-proxy's /proxy/8787/dtrain).
_ROOT_URL = "dtrain/"
_LIVE_URL = "dtrain/live.json"
_COLUMNS = 2

Run = tuple[str, dict, dict | None]  # (run id, latest payload, RunHistory.series() or None)

_executor: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_render_lock = threading.Lock()  # guards _runs_drawn (held while drawing: never taken on the event loop)
_runs_drawn: dict[tuple[str, str], tuple[str, str, tuple[str, ...]] | None] = {}  # (run, its shape) -> drawn
_last_page: tuple[str, str] | None = None  # (the page's shape, the page), replaced whole


def _num(value: Any) -> float:
    v = figure(value)
    return math.nan if v is None else v


def run_key(run: str) -> str:
    """A run's key in the page's element ids and source names (a run id may hold any character)."""
    return "r" + hashlib.sha1(run.encode("utf-8", "replace")).hexdigest()[:10]


def order(runs: list[Run]) -> list[Run]:
    """The newest run first, by when it started: an order that stays put while runs report in
    turn (an order by the latest report would redraw the page at every report)."""
    def started(run: Run) -> float:
        for v in (run[1].get("started"), run[1].get("time")):
            if math.isfinite(_num(v)):
                return _num(v)
        return -math.inf

    return sorted((r for r in runs if isinstance(r[1], dict)), key=lambda r: (-started(r), r[0]))


# ---------------------------------------------------------------------- words
def _header(run: str, payload: dict) -> str:
    facts = []
    step, steps = _num(payload.get("step")), _num(payload.get("steps"))
    if math.isfinite(step):
        facts.append(f"step {step:,.0f}" + (f" / {steps:,.0f}" if math.isfinite(steps) else ""))
    if not math.isnan(loss := _num(payload.get("loss"))):
        facts.append(f"loss {loss:.4g}")
    if math.isfinite(rate := _num(payload.get("samples_per_s"))):
        facts.append(f"{human_count(rate)} samples/s")
    if payload.get("final"):
        facts.append("finished")
    if math.isfinite(t := _num(payload.get("time"))):
        facts.append("updated " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)))
    name = payload.get("name")
    title = f"{html.escape(str(name))} <small>run {html.escape(run)}</small>" if isinstance(name, str) and name \
        else html.escape(run)
    return f"<h2>{title}</h2>\n<p>{html.escape('  ·  '.join(facts))}</p>"


def _findings(payload: dict) -> str:
    findings = payload.get("diagnosis")
    if not isinstance(findings, (list, tuple)):
        return ""
    if not findings:
        return "<p>findings: none</p>"
    items = "".join(f"<li>{html.escape(str(f))}</li>" for f in findings)
    return f'<h3>Findings</h3>\n<ul class="findings">{items}</ul>'


# ---------------------------------------------------------------------- the feed
def _plotted(runs: list[Run]) -> list[tuple[str, str, dict, dict[str, dict[str, list]] | None]]:
    """(run, key, payload, sources or None where malformed or beyond PLOTTED_RUNS), in page order."""
    out = []
    for n, (run, payload, series) in enumerate(order(runs)):
        sources = None
        if n < PLOTTED_RUNS:
            try:
                sources = run_sources(payload, series)
            except Exception as exc:  # one run's malformed payload never blanks the others
                logger.debug("dtrain dashboard: run %r has no figures (%s: %s)", run, type(exc).__name__, exc)
        out.append((str(run), run_key(str(run)), payload, sources))
    return out


def _shape_of(plotted: list[tuple[str, str, dict, Any]]) -> str:
    drawn = [[run, shape(sources) if sources is not None else None] for run, _, _, sources in plotted]
    return hashlib.sha1(json.dumps(drawn, sort_keys=True, default=str).encode()).hexdigest()[:16]


def live(runs: list[Run]) -> dict[str, Any]:
    """``/dtrain/live.json``: the shape the page must have been drawn for, every plotted source's
    columns by name (``<run key>/<source>``), and each run's header and findings by element id."""
    plotted = _plotted(runs)
    sources: dict[str, dict[str, list]] = {}
    text: dict[str, str] = {}
    for run, key, payload, src in plotted:
        text[f"{key}-head"] = _header(run, payload)
        text[f"{key}-findings"] = _findings(payload) if src is not None or payload else ""
        for name, cols in columns(src or {}).items():
            sources[f"{key}/{name}"] = cols
    return {"shape": _shape_of(plotted), "sources": jsonable(sources), "text": text}


# ---------------------------------------------------------------------- the page
_SCRIPT = """<script>
(function () {
  const shape = %(shape)s, every = %(every)d;
  const status = () => document.getElementById("dtrain-status");
  const numbers = (col) => col.map((v) => (v === null ? NaN : v));
  async function poll() {
    let next = every;
    try {
      const answer = await fetch("%(url)s", {cache: "no-store"});
      const feed = await answer.json();
      if (feed.error) throw new Error(feed.error);
      if (feed.shape !== shape) { location.reload(); return; }
      for (const doc of (window.Bokeh ? Bokeh.documents : [])) {
        for (const [name, cols] of Object.entries(feed.sources)) {
          const source = doc.get_model_by_name(name);
          if (source === null) continue;
          const data = {};
          for (const [k, v] of Object.entries(cols)) data[k] = numbers(v);
          source.data = data;
        }
      }
      for (const [id, text] of Object.entries(feed.text)) {
        const el = document.getElementById(id);
        if (el !== null && el.innerHTML !== text) el.innerHTML = text;
      }
      status().textContent = "";
    } catch (err) {
      status().textContent = "the scheduler did not answer (" + err + "); trying again";
      next = 2 * every;
    }
    setTimeout(poll, next);
  }
  setTimeout(poll, 300);
})();
</script>
"""
_STYLE = ("body{font-family:sans-serif;margin:0.5em 1em}h2{margin:0.6em 0 0.1em}h2 small{font-weight:normal;"
          "color:#666;font-size:60%}p{margin:0.2em 0}.findings li{margin:0.2em 0}#dtrain-status{color:#d62728}")


def _page(body: str, head: str = "", page_shape: str = "") -> str:
    script = _SCRIPT % {"shape": json.dumps(page_shape), "every": REFRESH_S * 1000, "url": _LIVE_URL}
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>dtrain</title>\n'
            f"<style>{_STYLE}</style>\n{head}</head>\n<body>\n<h1>dtrain</h1>\n<p id=\"dtrain-status\"></p>\n"
            f"{body}\n{script}</body>\n</html>\n")


def _draw_run(key: str, src: dict[str, dict[str, list]]) -> tuple[str, str, tuple[str, ...]] | None:
    """One run's figures as a Bokeh document of its own: (its script, its div, the bokehjs files
    it needs); None for a run without figures."""
    from bokeh.embed import components
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.layouts import gridplot
    from bokeh.resources import Resources

    from .figures import run_figures

    figs = run_figures(key, src)
    if not figs:
        return None
    # One root per run (a grid of its plots): Bokeh recomputes the document's models on every
    # root it adds, so a root per plot makes the drawing quadratic in the plots.
    root = gridplot(figs, ncols=_COLUMNS, merge_tools=False, toolbar_location=None, sizing_mode="stretch_width")
    script, div = components(root)
    bundle = bundle_for_objs_and_resources([root], Resources(mode="server", root_url=_ROOT_URL))
    return script, div, tuple(str(u.url) for u in bundle.js_files)


def _drawn(run: str, key: str, src: dict[str, dict[str, list]]) -> tuple[str, str, tuple[str, ...]] | None:
    """``_draw_run``, reused while the run's shape holds: a new run, or a replica joining one,
    redraws that run's figures only. Holds ``_render_lock`` (the drawing thread's)."""
    cache_key = (run, json.dumps(shape(src), sort_keys=True, default=str))
    if cache_key not in _runs_drawn:
        _runs_drawn[cache_key] = _draw_run(key, src)
        while len(_runs_drawn) > 2 * PLOTTED_RUNS:
            del _runs_drawn[next(iter(_runs_drawn))]
    return _runs_drawn[cache_key]


def render_page(runs: list[Run] | dict[str, dict]) -> str:
    """The whole page for ``runs`` (``[(run id, payload, series)]``, or ``{run id: payload}``
    without history), the newest run first."""
    if isinstance(runs, dict):
        runs = [(str(r), p, None) for r, p in runs.items()]
    plotted = _plotted(runs)
    page_shape = _shape_of(plotted)
    if not plotted:
        return _page(f"<p>{html.escape(EMPTY)}</p>", page_shape=page_shape)
    body, scripts, files = [], [], []
    with _render_lock:
        for n, (run, key, payload, src) in enumerate(plotted):
            head = f'<div id="{key}-head">{_header(run, payload)}</div>'
            findings = f'<div id="{key}-findings">{_findings(payload)}</div>'
            if n == PLOTTED_RUNS:
                head = f"<h2>Earlier runs</h2>\n<p>{html.escape(EARLIER)}</p>\n" + head
            div = ""
            if src is not None:
                try:
                    drawn = _drawn(run, key, src)
                except Exception as exc:  # one run's malformed payload never blanks the others
                    logger.debug("dtrain dashboard: skipping run %r (%s: %s)", run, type(exc).__name__, exc)
                    findings += f"<p>{html.escape(f'malformed telemetry: {exc}')}</p>"
                    drawn = None
                if drawn is not None:
                    script, div, needs = drawn
                    scripts.append(script)
                    files += [f for f in needs if f not in files]
            body.append(f"{head}\n{findings}\n{div}")
    head = "".join(f'<script src="{html.escape(u)}"></script>\n' for u in files) + "\n".join(scripts) + "\n"
    return _page("\n".join(body), head if scripts else "", page_shape)


def _render_cached(runs: list[Run]) -> str:
    """``render_page``, reused while the shape is the same (the page's script fetches the figures'
    newest columns at once)."""
    global _last_page
    page_shape = _shape_of(_plotted(runs))
    last = _last_page
    if last is not None and last[0] == page_shape:
        return last[1]
    page = render_page(runs)
    _last_page = (page_shape, page)
    return page


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _pool_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-dashboard")
        return _executor


def release_pool() -> None:
    """End the render thread (the scheduler plugin's close, once no plugin serves the page); a
    later page starts another."""
    global _executor
    with _pool_lock:
        executor, _executor = _executor, None
    if executor is not None:
        executor.shutdown(wait=False)


class PageHandler(web.RequestHandler):
    """``/dtrain``: the page for the runs ``source()`` returns (``[(run id, payload, series)]``)."""

    def initialize(self, source: Callable[[], list[Run]]) -> None:
        self._source = source

    async def get(self) -> None:
        try:
            page = await IOLoop.current().run_in_executor(_pool(), _render_cached, list(self._source()))
        except Exception as exc:  # the viewer sees why; the scheduler's log is not spammed every refresh
            logger.debug("dtrain dashboard: drawing the page failed", exc_info=True)
            page = _page(f"<p>{html.escape(f'the page could not be drawn: {type(exc).__name__}: {exc}')}</p>")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(page)


class LiveHandler(web.RequestHandler):
    """``/dtrain/live.json``: :func:`live` for ``source()``'s runs, rebuilt only when ``version()``
    (which changes with every payload the plugin takes) has changed."""

    def initialize(self, source: Callable[[], list[Run]], version: Callable[[], Any], cache: dict) -> None:
        self._source, self._version, self._cache = source, version, cache

    def get(self) -> None:
        version = self._version()
        if self._cache.get("version") != version or "body" not in self._cache:
            try:
                body = json.dumps(live(list(self._source())), separators=(",", ":"))
            except Exception as exc:
                logger.debug("dtrain dashboard: the feed failed", exc_info=True)
                body = json.dumps({"shape": "", "sources": {}, "text": {}, "error": f"{type(exc).__name__}: {exc}"})
            self._cache.update(version=version, body=body)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(self._cache["body"])
