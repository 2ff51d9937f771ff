"""Test helpers for telemetry: a hook that scrapes the scheduler's /metrics and the dtrain
dashboard page while the run goes (it runs in the chief, so it reads the live endpoints), one
that looks at the page in headless Chromium, and a Dask DataFrame whose partitions are slow to
read (an input-bound run)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.chief.hooks import Hook, RunView, StepContext


def fetch(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a 127.0.0.1 URL the test built
        return r.status, r.read().decode("utf-8", "replace")


class ScrapeHook(Hook):
    """Scrapes ``/metrics`` and ``/dtrain`` every ``every_s`` during the run; writes every scrape
    with dtrain series (and the page last served) to ``path`` as JSON."""

    def __init__(self, path: str, every_s: float = 1.0):
        self.path = Path(path)
        self.every_s = every_s
        self.base: str | None = None
        self.last = 0.0
        self.scrapes: list[dict[str, Any]] = []

    def begin(self, run: RunView) -> None:
        link = run.dashboard_link
        self.base = link.rsplit("/", 1)[0] if link else None

    def after_step(self, ctx: StepContext) -> None:
        now = time.monotonic()
        if self.base is None or now - self.last < self.every_s:
            return
        self.last = now
        status, text = fetch(self.base + "/metrics")
        if "dtrain_" in text:
            page_status, page = fetch(self.base + "/dtrain")
            js = re.search(r'src="/?(dtrain/static/[^"]+\.js)"', page)  # relative to the page
            js_status = fetch(f"{self.base}/{js.group(1)}")[0] if js else None
            self.scrapes.append({"step": ctx.step, "status": status, "metrics": text, "page_status": page_status,
                                 "page": page, "js_status": js_status})
            self.path.write_text(json.dumps(self.scrapes[-3:]))

    def end(self, run: RunView) -> None:
        """The scheduler's figures of the run as the run ends (``path`` with ``.data.json``)."""
        if self.base is not None:
            self.path.with_suffix(".data.json").write_text(fetch(self.base + "/dtrain/data.json")[1])


def slow_frame(parts: int = 10, rows: int = 64, delay_s: float = 0.1, seed: int = 0) -> Any:
    """A Dask DataFrame (4 features, a 2-class label) whose every partition takes ``delay_s`` to
    read: training on it waits for data."""
    import dask.dataframe as dd
    import pandas as pd

    def part(i: int) -> pd.DataFrame:
        time.sleep(delay_s)
        rng = np.random.default_rng(seed + i)
        y = rng.integers(0, 2, rows)
        x = rng.standard_normal((rows, 4)) + 2.0 * (2 * y[:, None] - 1)
        return pd.DataFrame({**{f"f{k}": x[:, k] for k in range(4)}, "label": y})

    return dd.from_map(part, list(range(parts)))


# What the browser reports of the /dtrain page: every Bokeh figure's title and where it was laid
# out, the run's loss points as the page holds them after its feed's updates, the findings as
# shown, and whether the page is wider than the window (a horizontal scrollbar).
PAGE_STATE = """(() => {
  if (!window.Bokeh || !Bokeh.documents.length || !Bokeh.index.all_views) return null;
  const figures = [];
  for (const v of Bokeh.index.all_views()) {
    if (v.model.constructor.__name__ !== "Figure") continue;
    const r = v.el.getBoundingClientRect();
    figures.push({title: v.model.title.text, left: r.left, right: r.right, width: r.width, height: r.height});
  }
  const ts = Bokeh.documents.map((d) => d.get_model_by_name("%(key)s/ts")).find((m) => m) || null;
  const loss = ts ? Array.from(ts.data.loss).filter((v) => Number.isFinite(v)) : [];
  const findings = document.getElementById("%(key)s-findings");
  const root = document.documentElement;
  return {figures, loss, findings: findings ? findings.innerText : "", scroll_width: root.scrollWidth,
          client_width: root.clientWidth, inner_width: window.innerWidth};
})()"""


class PageCheckHook(Hook):
    """Opens the run's ``/dtrain`` page in headless Chromium (tests.helpers.browser) while the run
    goes, once the scheduler holds a few points of it and ``finding`` among its findings; waits
    for the page to show them; writes what it saw to ``path`` (JSON) and a screenshot to ``shot``;
    then stops the run."""

    def __init__(self, path: str, shot: str, finding: str, points: int = 3, timeout_s: float = 60.0):
        self.path, self.shot, self.finding = Path(path), Path(shot), finding
        self.points, self.timeout_s = points, timeout_s
        self.thread: threading.Thread | None = None

    def begin(self, run: RunView) -> None:
        link = run.dashboard_link
        base = link.rsplit("/", 1)[0] if link else None
        self.thread = threading.Thread(target=self._check, args=(base, run.run_id), daemon=True,
                                       name="page-check")
        self.thread.start()

    def after_step(self, ctx: StepContext) -> None:
        if self.thread is not None and not self.thread.is_alive():
            ctx.request_stop("the page was checked")

    def end(self, run: RunView) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.timeout_s)

    def _check(self, base: str | None, run: str) -> None:
        from dtrain.observe.dashboard import run_key
        from tests.helpers.browser import Page, find_chromium

        out: dict[str, Any] = {"run": run}
        t0 = time.monotonic()
        try:
            assert base is not None, "the run has no dashboard"
            deadline = t0 + self.timeout_s
            while True:  # until the scheduler holds what the page must show
                data = json.loads(fetch(base + "/dtrain/data.json")[1])
                points = len((data.get("history", {}).get(run) or {}).get("t") or [])
                findings = (data.get("runs", {}).get(run) or {}).get("diagnosis") or []
                if points >= self.points and any(self.finding in f for f in findings):
                    break
                assert time.monotonic() < deadline, f"{points} points, findings {findings}"
                time.sleep(0.2)
            out["data_s"] = time.monotonic() - t0
            binary = find_chromium()
            assert binary is not None, "no chromium"
            with Page(binary, width=1280, height=900) as page:
                page.open(base + "/dtrain")
                expr = PAGE_STATE % {"key": run_key(run)}
                ready = f"(() => {{ const s = {expr}; return s && s.figures.length >= 5 && s.loss.length >= 2 " \
                        f"&& s.findings.includes({json.dumps(self.finding)}) ? s : null; }})()"
                state = page.wait_for(ready, timeout=max(deadline - time.monotonic(), 10.0))
                out["state"] = state or page.evaluate(expr)
                out["page_s"] = time.monotonic() - t0 - out["data_s"]
                if state:  # the page's feed adds the run's new points to the figures, with no reload
                    page.evaluate("window.dtrainUnreloaded = true")
                    grown = f"(() => {{ const s = {expr}; return s && s.loss.length > {len(state['loss'])}; }})()"
                    out["fed_in_place"] = bool(page.wait_for(grown, timeout=10.0)) \
                        and page.evaluate("window.dtrainUnreloaded === true")
                page.screenshot(self.shot)
                out["requests"], out["errors"] = page.requests, page.errors
        except BaseException as exc:  # the test reads it from the file
            out["error"] = f"{type(exc).__name__}: {exc}"
        self.path.write_text(json.dumps(out))
