"""A run's figures over time, as the scheduler keeps them for the ``/dtrain`` page.

Pure Python (no Dask, no Bokeh): the scheduler plugin hands every interval's payload (the chief's
telemetry, docs/observability.md) to :meth:`RunHistory.add`, with the memory of the tasks the run
uses, and the page reads :meth:`RunHistory.series`. A run of days at one payload every two seconds
sends about 43,000 payloads a day; the history holds at most ``max_points`` of them: when full,
its older half is thinned by merging neighbours in pairs (the mean of each figure), so recent
minutes keep full resolution and the start of the run stays in view at a coarser one.
"""

from __future__ import annotations

import math
from typing import Any

from .meters import figure

MAX_POINTS = 720  # points kept per run (times the columns: a few hundred KiB for a large run)
MAX_MARKS = 256  # checkpoints, recoveries and evaluations kept per run (the newest)
TOTAL = "total"  # the column of a figure summed over its parts


def _finite(value: Any) -> float | None:
    v = figure(value)
    return v if v is not None and math.isfinite(v) else None


def _kept(value: Any) -> float | None:
    """A figure as the history keeps it: six significant digits (a third of the feed's bytes of a
    full float, once per point rather than once per request)."""
    v = _finite(value)
    return v if v is None or v == 0 else float(f"{v:.6g}")


def _mean(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else _kept((a + b) / 2)


def _pairs(value: Any) -> list[tuple[float, float]]:
    """``[[step, time], ...]`` from a payload (tuples once msgpack has carried it), malformed entries skipped."""
    out = []
    for item in value if isinstance(value, (list, tuple)) else ():
        if isinstance(item, (list, tuple)) and len(item) == 2:
            step, t = _finite(item[0]), _finite(item[1])
            if step is not None and t is not None:
                out.append((step, t))
    return out


def table_name(key: str) -> str:
    """``tables.C1.weight`` -> ``C1``: a sparse table's name as the page and Prometheus show it."""
    return str(key).removeprefix("tables.").removesuffix(".weight")


class RunHistory:
    """One run's figures over time (see the module docstring): ``t`` (seconds since the run
    started), the run's own columns (``step``, ``loss``, ``steps_per_s``, ``samples_per_s``) and
    grouped ones (``replica`` steps per second, ``shard`` busy share, ``rows`` per table, ``memory``
    per task), plus the evaluations, checkpoints and recoveries at their times."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 4:
            raise ValueError(f"max_points: {max_points} is too few to thin (at least 4)")
        self.max_points = max_points
        self.t0: float | None = None
        self.t: list[float] = []
        self.columns: dict[str, list[float | None]] = {}
        self.groups: dict[str, dict[str, list[float | None]]] = {"replica": {}, "shard": {}, "rows": {}, "memory": {}}
        self.evals: list[dict[str, float | None]] = []
        self.marks: dict[str, list[tuple[float, float]]] = {"checkpoint": [], "recovery": []}
        self.limits: dict[str, float] = {}  # task -> its worker's memory limit (the newest seen)
        self.memory: dict[str, float] = {}  # task -> its worker's memory in use (the newest seen)
        self.version = 0  # bumped by every change: a reader caches on it
        self._last: tuple[float, float] | None = None  # (step, time) of the previous payload

    def __len__(self) -> int:
        return len(self.t)

    def add(self, payload: dict[str, Any], memory: dict[str, tuple[float | None, float | None]] | None = None) -> bool:
        """Add one interval's ``payload``, and ``memory`` (``{task: (bytes in use, limit)}``, a
        limit of None or 0 meaning none); False, adding no point, for a payload without a time or
        for the run's final one (its rates are over the whole run, not an interval: only its
        checkpoints, recoveries and evaluation are taken)."""
        now = _finite(payload.get("time"))
        if now is None:
            return False
        if payload.get("final"):
            if self.t0 is not None:
                self._marks(payload)
                self.version += 1
            return False
        if self.t0 is None:
            started = _finite(payload.get("started"))
            self.t0 = started if started is not None and started <= now else now
        t = round(now - self.t0, 3)
        if self.t and t < self.t[-1]:  # a payload older than the last one (clocks, a reordering): dropped
            return False
        step = _finite(payload.get("step"))
        rate = None
        if step is not None and self._last is not None and now > self._last[1] and step >= self._last[0]:
            rate = _kept((step - self._last[0]) / (now - self._last[1]))
        if step is not None:
            self._last = (step, now)
        row = {"step": step, "loss": _kept(payload.get("loss")), "steps_per_s": rate,
               "samples_per_s": _kept(payload.get("samples_per_s"))}
        grouped: dict[str, dict[str, float | None]] = {g: {} for g in self.groups}
        for key, rep in _dicts(payload.get("replicas")):
            grouped["replica"][key] = _kept(rep.get("steps_per_s"))
        for key, shard in _dicts(payload.get("shards")):
            grouped["shard"][key] = _kept(shard.get("busy_frac"))
            for name, figures in _dicts(shard.get("tables")):
                rows = _finite(figures.get("live_rows"))
                if rows is not None:
                    table = table_name(name)
                    grouped["rows"][table] = (grouped["rows"].get(table) or 0.0) + rows
        for task, (used, limit) in (memory or {}).items():
            used, limit = _finite(used), _finite(limit)
            if used is not None:
                grouped["memory"][task] = self.memory[task] = used
            if limit:
                self.limits[task] = limit
        self._append(t, row, grouped)
        self._marks(payload)
        self.version += 1
        return True

    def _append(self, t: float, row: dict[str, float | None], grouped: dict[str, dict[str, float | None]]) -> None:
        n = len(self.t)
        self.t.append(t)
        for key, value in row.items():
            self.columns.setdefault(key, [None] * n).append(value)
        for group, values in grouped.items():
            cols = self.groups[group]
            for key in values.keys() - cols.keys():  # a replica, shard or table seen first now
                cols[key] = [None] * n
            for key, col in cols.items():
                col.append(values.get(key))
        if len(self.t) > self.max_points:
            self._thin()

    def _thin(self) -> None:
        """Merge the older half's points in pairs (the mean of each figure, at the earlier point's
        time, so the run's first point stays at its start): a full history keeps three quarters."""
        half = (len(self.t) // 2) // 2 * 2

        def merged(col: list[Any]) -> list[Any]:
            return [_mean(col[i], col[i + 1]) for i in range(0, half, 2)] + col[half:]

        self.t = self.t[0:half:2] + self.t[half:]
        self.columns = {k: merged(v) for k, v in self.columns.items()}
        self.groups = {g: {k: merged(v) for k, v in cols.items()} for g, cols in self.groups.items()}

    def _marks(self, payload: dict[str, Any]) -> None:
        assert self.t0 is not None
        for kind, key in (("checkpoint", "checkpoints"), ("recovery", "recoveries")):
            seen = self.marks[kind]
            known = {step for _, step in seen}
            for step, when in _pairs(payload.get(key)):
                if step not in known:
                    seen.append((max(when - self.t0, 0.0), step))
                    known.add(step)
            seen.sort()
            del seen[:-MAX_MARKS]
        ev = payload.get("eval")
        if isinstance(ev, dict) and (ev_step := _finite(ev.get("step"))) is not None \
                and all(e["step"] != ev_step for e in self.evals):
            when = _finite(ev.get("time")) or _finite(payload.get("time")) or self.t0
            self.evals.append({"t": max(when - self.t0, 0.0), "step": ev_step, "loss": _finite(ev.get("loss")),
                               "accuracy": _finite(ev.get("accuracy"))})
            self.evals.sort(key=lambda e: e["t"] or 0.0)
            del self.evals[:-MAX_MARKS]

    def series(self) -> dict[str, Any]:
        """The history as plain lists (JSON-able; None where a figure is missing)."""
        return {"t": list(self.t), **{k: list(v) for k, v in self.columns.items()},
                "groups": {g: {k: list(v) for k, v in cols.items()} for g, cols in self.groups.items()},
                "evals": [dict(e) for e in self.evals],
                "marks": {k: [{"t": t, "step": s} for t, s in v] for k, v in self.marks.items()},
                "memory": dict(self.memory), "limits": dict(self.limits)}


def _dicts(value: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(str(k), v) for k, v in value.items() if isinstance(v, dict)] if isinstance(value, dict) else []


# ---------------------------------------------------------------------- human units
_BYTES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNTS = ("", "k", "M", "G", "T")


def human_bytes(n: float | None) -> str:
    """``3_000_000_000`` -> ``2.8 GiB`` (the page's axes format bytes the same way in the browser)."""
    if n is None or not math.isfinite(n):
        return "-"
    unit = 0
    while abs(n) >= 1024 and unit < len(_BYTES) - 1:
        n /= 1024
        unit += 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.3g} {_BYTES[unit]}"


def human_count(n: float | None) -> str:
    """``1_250_000`` -> ``1.25M``; below a thousand, as is (``12.5``)."""
    if n is None or not math.isfinite(n):
        return "-"
    unit = 0
    while abs(n) >= 1000 and unit < len(_COUNTS) - 1:
        n /= 1000
        unit += 1
    return f"{n:.3g}{_COUNTS[unit]}"


def human_duration(seconds: float | None) -> str:
    """``3725`` -> ``1h02m``, ``200`` -> ``3m20s``, ``42.44`` -> ``42.4s`` (the page's time axis)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if abs(seconds) < 60:
        return f"{round(seconds, 1):g}s"
    s = int(round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def jsonable(value: Any) -> Any:
    """Strict JSON: NaN and infinities (a missing bar, a diverged loss) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
