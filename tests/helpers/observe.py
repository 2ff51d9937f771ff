"""Test helpers for telemetry: a hook that scrapes the scheduler's /metrics and the dtrain
dashboard page while the run goes (it runs in the chief, so it reads the live endpoints), and a
Dask DataFrame whose partitions are slow to read (an input-bound run)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.chief.hooks import Hook, StepContext


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

    def begin(self, session: Any) -> None:
        link = session.conn.dashboard_link
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
