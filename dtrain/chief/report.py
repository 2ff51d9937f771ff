"""``dtrain report RUN_DIR``: a run's loss and eval curves as a PNG, and a short plain-text table.

Reads ``metrics.jsonl`` (training records: ``step``, ``loss``, ``samples_per_sec``, ...; eval
records: ``step``, ``eval``) and, when present, ``summary.json``. A resumed run appends to
``metrics.jsonl`` and may log some steps twice (those after the checkpoint it resumed from):
the later record of a step wins. An unreadable line (a run killed mid-write) is skipped.

When ``summary.json`` has the run's telemetry (``replicas_stats``, ``shards_stats``, ``diagnosis``:
docs/observability.md), the PNG adds a row of panels and the text the per-replica and per-shard
tables and the findings (``report_panels``).

Matplotlib is used through its Agg canvas directly (no pyplot, no global backend switch), so
rendering works headless and does not disturb a caller's own plotting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dtrain.observe.style import ACCURACY, EVAL_LOSS, TRAIN_LOSS

from . import report_panels
from .report_panels import _number

MAX_ROWS = 20


def read_metrics(path: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]], int]:
    """(training records by step, eval results by step, unreadable lines) from a metrics.jsonl.

    Raises ValueError naming the file when it is missing or holds no record.
    """
    path = Path(path)
    if not path.is_file():
        where = path.parent
        hint = "" if where.is_dir() else f" ({where} does not exist)"
        raise ValueError(f"{path}: not found{hint}; is this a dtrain run directory?")
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    bad = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
            except (ValueError, TypeError, KeyError):
                bad += 1
                continue
            if isinstance(rec.get("eval"), dict):
                evals[step] = rec["eval"]
            elif "loss" in rec or "samples_per_sec" in rec:
                train[step] = rec
    if not train and not evals:
        raise ValueError(f"{path}: no metrics records (empty{f', {bad} unreadable line(s)' if bad else ''})")
    return dict(sorted(train.items())), dict(sorted(evals.items())), bad


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _sample(items: list[Any], n: int = MAX_ROWS) -> list[Any]:
    """At most ``n`` items, evenly spaced, always the first and the last."""
    if len(items) <= n:
        return items
    picks = sorted({round(i * (len(items) - 1) / (n - 1)) for i in range(n)})
    return [items[i] for i in picks]


def _pick_steps(steps: list[int], eval_steps: list[int], n: int) -> list[int]:
    """At most ``n`` steps: the first, the last, the evaluations (up to half the rows, evenly
    sampled), and evenly spaced training steps for the rest."""
    if len(steps) <= n:
        return steps
    must = {steps[0], steps[-1], *_sample(eval_steps, max(n // 2, 1))}
    others = [s for s in steps if s not in must]
    return sorted(must | set(_sample(others, n - len(must)) if n > len(must) else ()))


def _fmt(value: Any, spec: str) -> str:
    v = _number(value)
    return "-" if v is None else format(v, spec)


def table(train: dict[int, dict[str, Any]], evals: dict[int, dict[str, Any]],
          summary: dict[str, Any] | None, max_rows: int = MAX_ROWS) -> str:
    """The plain-text table: a header, at most ``max_rows`` evenly sampled steps, the final line."""
    has_eval_loss = any(_number(e.get("loss")) is not None for e in evals.values())
    has_acc = any(_number(e.get("accuracy")) is not None for e in evals.values())
    cols = [("step", 8), ("loss", 10), ("samples/s", 10)]
    if has_eval_loss:
        cols.append(("eval loss", 10))
    if has_acc:
        cols.append(("eval acc", 9))
    lines = []
    if summary is not None:
        how = " ".join(str(summary[k]) for k in ("mode", "replication") if summary.get(k))
        lines.append(f"run {summary.get('name', '?')}: {summary.get('status', '?')}"
                     + (f", {how}" if how else "") + f", {summary.get('replicas', '?')} replica(s)")
    lines.append("".join(f"{name:>{width}}" for name, width in cols))
    for step in _pick_steps(sorted(set(train) | set(evals)), sorted(evals), max_rows):
        rec, ev = train.get(step, {}), evals.get(step, {})
        cells = [f"{step:>8}", f"{_fmt(rec.get('loss'), '.4f'):>10}", f"{_fmt(rec.get('samples_per_sec'), '.0f'):>10}"]
        if has_eval_loss:
            cells.append(f"{_fmt(ev.get('loss'), '.4f'):>10}")
        if has_acc:
            cells.append(f"{_fmt(ev.get('accuracy'), '.3f'):>9}")
        lines.append("".join(cells))
    lines.append(_final_line(train, evals, summary))
    return "\n".join(lines)


def _final_line(train: dict[int, dict[str, Any]], evals: dict[int, dict[str, Any]],
                summary: dict[str, Any] | None) -> str:
    if summary is None:
        last = max(set(train) | set(evals))
        return f"final: step {last} (no summary.json: the run is still going, or was killed)"
    parts = [f"final: step {summary.get('global_step', '?')}", f"status {summary.get('status', '?')}"]
    if _number(summary.get("final_loss")) is not None:
        parts.append(f"loss {summary['final_loss']:.4f}")
    ev_raw = summary.get("eval")
    ev: dict[str, Any] = ev_raw if isinstance(ev_raw, dict) else {}
    if _number(ev.get("loss")) is not None:
        parts.append(f"eval loss {ev['loss']:.4f}")
    if _number(ev.get("accuracy")) is not None:
        parts.append(f"eval acc {ev['accuracy']:.3f}")
    if _number(summary.get("samples_per_sec")) is not None:
        parts.append(f"samples/s {summary['samples_per_sec']:.0f}")
    if _number(summary.get("wall_s")) is not None:
        parts.append(f"wall {summary['wall_s']:.1f} s")
    if summary.get("recoveries"):
        parts.append(f"recoveries {summary['recoveries']}")
    text = "  ".join(parts)
    if summary.get("error"):
        text += f"\nerror: {summary['error']}"
    return text


def _draw_curves(fig: Any, train: dict[int, dict[str, Any]], evals: dict[int, dict[str, Any]],
                 acc: list[tuple[int, float | None]]) -> None:
    """Training loss (and eval loss) vs step, and eval accuracy vs step when there is one, on ``fig``
    (a Figure or SubFigure). The panels share the step axis: a run evaluated once shows that
    evaluation where it falls in the run, not alone on an axis of its own."""
    axes = fig.subplots(1, 2 if acc else 1, squeeze=False, sharex=True)[0]
    ax = axes[0]
    loss = [(s, _number(r.get("loss"))) for s, r in train.items() if _number(r.get("loss")) is not None]
    if loss:
        ax.plot([s for s, _ in loss], [v for _, v in loss], label="training loss", color=TRAIN_LOSS)
    ev_loss = [(s, _number(e.get("loss"))) for s, e in evals.items() if _number(e.get("loss")) is not None]
    if ev_loss:
        ax.plot([s for s, _ in ev_loss], [v for _, v in ev_loss], "o--", label="eval loss", color=EVAL_LOSS)
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(True, alpha=0.3)
    if loss or ev_loss:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss recorded", ha="center", va="center", transform=ax.transAxes)
    if acc:
        ax2 = axes[1]
        ax2.plot([s for s, _ in acc], [v for _, v in acc], "o-", color=ACCURACY, label="eval accuracy")
        ax2.set_xlabel("global step")
        ax2.set_ylabel("accuracy")
        ax2.set_title("eval accuracy")
        ax2.set_ylim(0, 1.02)
        ax2.grid(True, alpha=0.3)


def plot(train: dict[int, dict[str, Any]], evals: dict[int, dict[str, Any]], summary: dict[str, Any] | None,
         out: Path) -> Path:
    """Training loss (and eval loss) vs step, and eval accuracy vs step, to a PNG (written atomically).

    When ``summary`` has the run's telemetry (``report_panels.panels``), a second row below adds the
    time per replica, the per-shard load and the staleness histogram; without it the figure is the
    curves alone, as it always was.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    acc = [(s, _number(e.get("accuracy"))) for s, e in evals.items() if _number(e.get("accuracy")) is not None]
    width, height = (11, 4.2) if acc else (6.5, 4.2)
    extra = report_panels.panels(summary)
    if not extra:
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        _draw_curves(fig, train, evals, acc)
    else:
        below = report_panels.row_height(summary)
        fig = Figure(figsize=(max(width, report_panels.PANEL_WIDTH * len(extra)), height + below), dpi=100,
                     layout="constrained")
        FigureCanvasAgg(fig)
        # matplotlib's stubs: SubFigure | ndarray, whatever the grid (2 x 1 is an array of two)
        top, bottom = fig.subfigures(2, 1, height_ratios=[height, below])  # type: ignore[misc]
        _draw_curves(top, train, evals, acc)
        report_panels.draw(bottom, summary)
    if summary is not None:
        fig.suptitle(f"{summary.get('name', '')} ({summary.get('status', '?')}, step {summary.get('global_step', '?')})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def render(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Plot ``run_dir``'s curves to ``out`` (default ``run_dir/report.png``); return it and the text:
    the table, then the per-replica and per-shard tables and the diagnosis when summary.json has them.

    Raises ValueError naming the file when ``metrics.jsonl`` is missing or empty.
    """
    run_dir = Path(run_dir)
    train, evals, bad = read_metrics(run_dir / "metrics.jsonl")
    summary = _read_summary(run_dir)
    png = plot(train, evals, summary, Path(out) if out is not None else run_dir / "report.png")
    text = table(train, evals, summary)
    telemetry = report_panels.text(summary)
    if telemetry:
        text += "\n\n" + telemetry
    if bad:
        text += f"\n({bad} unreadable line(s) in metrics.jsonl skipped)"
    return png, text
