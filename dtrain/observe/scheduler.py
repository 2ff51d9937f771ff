"""dtrain's scheduler plugin: the runs' telemetry, served beside Dask's dashboard.

The chief logs each interval's figures as an event on ``TOPIC`` (``client.log_event``); Dask's
event broker hands every event to every scheduler plugin's ``log_event``, so ``TelemetryPlugin``
keeps the latest payload per run, and the run's figures over time (dtrain/observe/history.py,
with the memory of the workers its tasks run on, which the scheduler knows from their
heartbeats), without a subscription or a handler of its own on the comm. Runs are keyed by their
id (``<name>-<token>``, one per start of a pipeline), so two runs of one pipeline never mix. It
serves them where an operator already looks (docs/observability.md):

- as ``dtrain_*`` series on the scheduler's own ``/metrics`` (one collector in
  ``prometheus_client.REGISTRY``, registered once per process, reading every live plugin);
- as a ``/dtrain`` page on the dashboard (dtrain/observe/dashboard.py), with bokehjs served from
  bokeh's own static files under ``/dtrain/static/`` so the page needs no CDN, and its feed
  ``/dtrain/live.json``;
- as JSON on ``/dtrain/data.json`` (every run's latest payload, and its history under ``history``).

The chief registers the plugin on connecting (``dtrain.deploy.plugin.register``); the scheduler
unpickles it, so dtrain must be importable there. Where it is not, the run goes on without the
series and the page.

``prometheus_client``'s registry is one per process, so where one process runs several schedulers
(the tests) every scheduler's ``/metrics`` shows the runs of all of them, as with distributed's
own collectors; the page and the JSON are each scheduler's own.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import weakref
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from .history import RunHistory, jsonable

logger = logging.getLogger(__name__)

TOPIC = "dtrain-telemetry"
NAME = "dtrain-telemetry"
MAX_RUNS = 64  # runs kept per scheduler: a long-lived deployed scheduler sees run after run

_lock = threading.Lock()  # the scheduler's loop adds plugins; a scrape may read from another thread
_live: weakref.WeakSet[TelemetryPlugin] = weakref.WeakSet()
_routed: weakref.WeakSet[Any] = weakref.WeakSet()  # schedulers whose http application has the routes
_collector_registered = False


class TelemetryPlugin(SchedulerPlugin):
    """Keep the latest telemetry payload per run, and serve it as series, a page and JSON."""

    name = NAME
    idempotent = True  # a second run's chief on a long-lived scheduler keeps the plugin and the runs it holds

    def __init__(self) -> None:
        self._payloads: dict[str, dict] = {}
        self._histories: dict[str, RunHistory] = {}
        self._scheduler: Any = None
        self.version = 0  # bumped by every payload taken: the page's feed is rebuilt only then

    async def start(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        with _lock:
            _live.add(self)
        _register_collector()
        _add_routes(scheduler)

    async def close(self) -> None:
        with _lock:
            _live.discard(self)
            last = not _live
        if last:  # the page's render thread goes with the last plugin that served it
            from dtrain.observe.dashboard import release_pool

            release_pool()

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != TOPIC:
            return
        run = msg.get("run") if isinstance(msg, dict) else None
        if not isinstance(run, str) or not run:
            logger.debug("dtrain telemetry: skipping an event without a run name: %.200r", msg)
            return
        payloads = dict(self._payloads)  # replaced, never edited: a reader on another thread holds a whole one
        payloads.pop(run, None)  # the latest updated run last, the longest silent first out
        payloads[run] = msg
        while len(payloads) > MAX_RUNS:
            del payloads[next(iter(payloads))]
        self._payloads = payloads
        history = self._histories.get(run)
        if history is None:
            history = self._histories[run] = RunHistory()
        for gone in self._histories.keys() - payloads.keys():
            del self._histories[gone]
        try:
            history.add(msg, _memory(self._scheduler, msg.get("hosts")))
        except Exception as exc:  # a malformed payload costs its point, never the event broker
            logger.debug("dtrain telemetry: run %r: no history point (%s: %s)", run, type(exc).__name__, exc)
        self.version += 1

    def payloads(self) -> dict[str, dict]:
        """``{run: latest payload}``, the longest silent run first."""
        return self._payloads

    def runs(self) -> list[tuple[str, dict, dict | None]]:
        """``[(run, latest payload, its history's series)]``: what the page draws. Called on the
        scheduler's event loop, where ``log_event`` runs, so a history is never read mid-update."""
        return [(run, payload, h.series() if (h := self._histories.get(run)) is not None and len(h) else None)
                for run, payload in self._payloads.items()]


def _memory(scheduler: Any, hosts: Any) -> dict[str, tuple[float | None, float | None]]:
    """``{task: (bytes in use, memory limit)}`` of the workers a run's tasks are on, as the
    scheduler last heard from them (the process's RSS, and ``memory_limit``, 0 for none)."""
    workers = getattr(scheduler, "workers", None)
    if not isinstance(hosts, dict) or not workers:
        return {}
    out: dict[str, tuple[float | None, float | None]] = {}
    for task, address in hosts.items():
        ws = workers.get(address) if isinstance(address, str) else None
        if ws is None:
            continue
        try:
            out[str(task)] = (float(ws.memory.process), float(ws.memory_limit or 0))
        except Exception:  # a worker that has not sent a heartbeat yet
            continue
    return out


def _installed(plugin: TelemetryPlugin) -> bool:
    """Whether the plugin is still its scheduler's (not replaced by a re-registration, not removed)."""
    scheduler = plugin._scheduler
    return scheduler is not None and any(p is plugin for p in list(getattr(scheduler, "plugins", {}).values()))


def _all_payloads() -> dict[str, dict]:
    """Every live plugin's runs; where two schedulers hold the same run, the later payload."""
    with _lock:
        plugins = list(_live)
    merged: dict[str, dict] = {}
    for plugin in plugins:
        if not _installed(plugin):
            continue
        for run, payload in plugin.payloads().items():
            if run not in merged or _time(payload) >= _time(merged[run]):
                merged[run] = payload
    return merged


def _time(payload: Any) -> float:
    t = payload.get("time") if isinstance(payload, dict) else None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else -math.inf


def _plugin_of(scheduler: Any) -> TelemetryPlugin | None:
    plugins = [p for p in list(getattr(scheduler, "plugins", {}).values()) if isinstance(p, TelemetryPlugin)]
    return plugins[0] if plugins else None


def _payloads_of(scheduler: Any) -> dict[str, dict]:
    """The runs this scheduler's plugin holds (none where the plugin is gone)."""
    plugin = _plugin_of(scheduler)
    return plugin.payloads() if plugin is not None else {}


def _runs_of(scheduler: Any) -> list[tuple[str, dict, dict | None]]:
    plugin = _plugin_of(scheduler) if scheduler is not None else None
    return plugin.runs() if plugin is not None else []


def _version_of(scheduler: Any) -> tuple[int, int]:
    """Changes with every payload, and with the plugin itself (re-registered: its runs start over)."""
    plugin = _plugin_of(scheduler) if scheduler is not None else None
    return (id(plugin), plugin.version) if plugin is not None else (0, 0)


def _register_collector() -> None:
    global _collector_registered
    with _lock:
        if _collector_registered:
            return
        _collector_registered = True
    try:
        import prometheus_client

        from dtrain.observe.prometheus import TelemetryCollector
    except ImportError as exc:
        logger.debug("dtrain telemetry: no Prometheus series (%s)", exc)
        return
    prometheus_client.REGISTRY.register(TelemetryCollector(_all_payloads))


class DataHandler(web.RequestHandler):
    """``/dtrain/data.json``: ``{"runs": {run: payload}, "history": {run: series}}``."""

    def initialize(self, scheduler: weakref.ref) -> None:
        self._scheduler = scheduler

    def get(self) -> None:
        runs = _runs_of(self._scheduler())
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"runs": jsonable({r: p for r, p, _ in runs}),
                               "history": jsonable({r: s for r, _, s in runs if s is not None})}, default=str))


def _add_routes(scheduler: Any) -> None:
    """The page, its JSON and bokehjs, once per scheduler (a re-registered plugin keeps them: the
    handlers look the plugin up on each request)."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return
    with _lock:
        if scheduler in _routed:
            return
        _routed.add(scheduler)
    from bokeh.settings import settings

    from dtrain.observe.dashboard import STATIC_ROOT, LiveHandler, PageHandler

    ref = weakref.ref(scheduler)
    app.add_handlers(r".*$", [
        (r"/dtrain", PageHandler, {"source": lambda: _runs_of(ref())}),
        (r"/dtrain/live\.json", LiveHandler, {"source": lambda: _runs_of(ref()), "version": lambda: _version_of(ref()),
                                              "cache": {}}),
        (r"/dtrain/data\.json", DataHandler, {"scheduler": ref}),
        (STATIC_ROOT + r"(.*)", web.StaticFileHandler, {"path": str(settings.bokehjs_path())}),
    ])


def page_link(dashboard_link: str | None) -> str | None:
    """The ``/dtrain`` page's address beside the dashboard's (``http://host:8787/status`` ->
    ``http://host:8787/dtrain``; a proxied ``.../proxy/8787/status`` keeps its prefix)."""
    if not dashboard_link:
        return None
    parts = urlsplit(dashboard_link)
    base = parts.path.rsplit("/", 1)[0] if parts.path else ""
    return urlunsplit((parts.scheme, parts.netloc, base + "/dtrain", "", ""))
