"""``dtrain.chief.report.render``: a run's curves to a PNG and a short table (on a real in-process run,
and on hand-written metrics files for the edge cases), and the telemetry it adds when summary.json has
it (``dtrain.chief.report_panels``: docs/observability.md, "`dtrain report`")."""

from __future__ import annotations

import json
import re

import pytest

import dtrain
from dtrain.chief import report_panels
from dtrain.chief.report import MAX_ROWS, render
from dtrain.chief.report_panels import SHARD_LOAD, STALENESS, TIME_PER_REPLICA, panels
from dtrain.cli import main
from tests.helpers.pipelines import pipeline_yaml

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SPEC = pipeline_yaml("report-run", jobs={"ps": 1, "worker": 2}, mode="sync", steps=60, eval={"every_steps": 20})


def _rows(text: str) -> list[list[str]]:
    """The step table's rows (those before the final line; the telemetry tables come after it)."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("final: ")), len(lines))
    return [line.split() for line in lines[:end] if re.match(r"^\s+\d+\s", line)]


def _final(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("final: "))


def test_render_a_real_run(inproc_client, run_dir, tmp_path, capsys):
    summary = dtrain.run(dtrain.loads(SPEC, base_dir="."), client=inproc_client, run_dir=run_dir).summary
    assert summary["status"] == "completed"
    png, text = render(run_dir)
    assert png == run_dir / "report.png"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    from matplotlib.image import imread

    assert imread(png).shape[0] > 100
    assert "report-run: completed" in text
    header = text.splitlines()[1].split()
    assert header[:2] == ["step", "loss"] and "acc" in header
    rows = _rows(text)
    assert [r[0] for r in rows] == ["10", "20", "30", "40", "50", "60"]
    assert all(r[1] != "-" for r in rows)  # a training loss on every summary step
    assert rows[1][-1] != "-" and rows[0][-1] == "-"  # eval accuracy at 20 (every_steps), none at 10
    final = _final(text)
    assert final.startswith("final: step 60") and "status completed" in final
    # The diagnosis is printed exactly when the run's summary has one (a run with telemetry).
    assert ("diagnosis" in summary) == any(line.startswith("diagnosis") for line in text.splitlines())
    assert f"eval acc {summary['eval']['accuracy']:.3f}" in final
    # --out elsewhere (folders created); the CLI prints the same table and the plot's path.
    other, _ = render(run_dir, tmp_path / "plots" / "r.png")
    assert other == tmp_path / "plots" / "r.png" and other.read_bytes().startswith(PNG_MAGIC)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "cli.png")]) == 0
    out = capsys.readouterr().out
    assert "final: step 60" in out and (tmp_path / "cli.png").is_file()


def test_missing_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"nope/metrics\.jsonl: not found .*does not exist"):
        render(tmp_path / "nope")


def test_empty_metrics_is_a_clear_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: no metrics records \(empty\)"):
        render(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: no metrics records \(empty, 1 unreadable line"):
        render(tmp_path)
    assert not (tmp_path / "report.png").exists()


def test_long_resumed_killed_run_is_sampled_deduplicated_and_readable(tmp_path):
    """200 summary records, a resume that re-logged steps 1510..1600, eval records, no summary.json
    (killed) and a torn last line: at most MAX_ROWS rows, first and last kept, later records win."""
    lines = [{"step": s, "time": s, "loss": 3.0 - s / 1000, "samples_per_sec": 1000.0, "dropped_stale": 0}
             for s in range(10, 1601, 10)]
    lines += [{"step": 500 * k, "eval": {"loss": 1.0 / k, "accuracy": 0.2 * k}} for k in (1, 2, 3)]
    lines += [{"step": s, "time": s, "loss": 0.5, "samples_per_sec": 2000.0, "dropped_stale": 0}
              for s in range(1510, 2001, 10)]
    lines.append({"step": 1800, "time": 1, "loss": None, "samples_per_sec": 2000.0})  # NaN loss, logged as null
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": 2010, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    png, table = render(tmp_path)
    assert png.read_bytes().startswith(PNG_MAGIC)
    rows = _rows(table)
    assert len(rows) <= MAX_ROWS
    steps = [int(r[0]) for r in rows]
    assert steps[0] == 10 and steps[-1] == 2000 and steps == sorted(steps)
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert max(gaps) <= 2 * (2000 // MAX_ROWS)  # evenly spread, not bunched
    resumed = [r for r in rows if 1510 <= int(r[0]) <= 1600]  # logged twice: once by each run
    assert resumed and all(r[1] == "0.5000" for r in resumed)  # the resumed run's records won
    assert table.splitlines()[-2].startswith("final: step 2000 (no summary.json")
    assert table.splitlines()[-1] == "(1 unreadable line(s) in metrics.jsonl skipped)"


def test_failed_run_summary_shows_its_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 2.0, "samples_per_sec": 10.0}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({
        "name": "n", "status": "failed", "global_step": 7, "final_loss": None, "eval": None,
        "error": "nan_guard: replica 0 reported a non-finite loss"}))
    _, table = render(tmp_path)
    assert "eval" not in table.splitlines()[1]  # no eval columns without eval records
    assert table.splitlines()[-2] == "final: step 7  status failed"
    assert table.splitlines()[-1].startswith("error: nan_guard")


# --- telemetry (summary.json's replicas_stats, shards_stats and diagnosis) ---------------------------

LE = [0, 1, 2, 4, 8, 16, 32]
FINDINGS = [
    "straggler: replica 1 (/job:worker/task:1) ran 12.0 steps/s, below 0.5 of the median 300.0",
    "hot shard: shard 0 (/job:ps/task:0) busy 0.91 of the time; holds 0.weight",
]


def _replica(i: int, steps_per_s: float, data_frac: float) -> dict:
    return {"task": f"/job:worker/task:{i}", "steps": 600, "steps_per_s": steps_per_s, "compute_s": 1.2,
            "data_s": 0.01, "ps_s": 0.3, "compute_frac": 0.7, "data_frac": data_frac, "ps_frac": 0.2,
            "bytes_sent": 123456, "bytes_recv": 123456}


def _shard(i: int, busy: float, counts: list[int] | None) -> dict:
    stats = {"task": f"/job:ps/task:{i}", "variables": [f"{i}.weight"], "pushes": 1200, "applies": 1190,
             "applies_per_s": 800.0, "busy_frac": busy, "bytes_in": 1_500_000 * (i + 1), "bytes_out": 2_250_000,
             "dropped": 10 + i}
    stats["staleness"] = None if counts is None else {
        "le": LE, "counts": counts, "mean": 1.0 + i, "max": 7 + i, "loss": [0.2, 0.21, None, None, None, None, None, None]}
    return stats


def _summary(**extra) -> dict:
    return {"name": "tele", "status": "completed", "global_step": 60, "replicas": 3, "final_loss": 1.4, **extra}


def _telemetry(diagnosis: list | None = None) -> dict:
    return _summary(
        replicas_stats={"0": _replica(0, 300.0, 0.01), "1": _replica(1, 12.0, 0.01), "2": _replica(2, 310.0, 0.35)},
        shards_stats={"0": _shard(0, 0.91, [5, 100, 50, 20, 5, 0, 0, 0]), "1": _shard(1, 0.3, [1, 2, 3, 4, 5, 6, 7, 8])},
        diagnosis=FINDINGS if diagnosis is None else diagnosis)


def _write_run(path, summary: dict | None):
    """A small run directory: training records that carry per-interval ``replicas``/``shards`` (as a
    run with telemetry logs them), and ``summary`` as summary.json."""
    path.mkdir(parents=True, exist_ok=True)
    recs = [{"step": s, "time": s, "loss": 2.0 - s / 100, "samples_per_sec": 900.0,
             "replicas": {"0": {"steps": s, "steps_per_s": 300.0, "compute_frac": 0.7}},
             "shards": {"0": {"pushes": 2 * s, "busy_frac": 0.3, "staleness": {"le": LE, "counts": [1] * 8}}}}
            for s in range(10, 61, 10)]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def _table(lines: list[str], header: list[str]) -> list[list[str]]:
    """The rows (split into cells) under the line whose cells are ``header``, up to the blank line."""
    start = next(i for i, line in enumerate(lines) if line.split() == header) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return [line.split() for line in lines[start:end]]


def _pixels(png) -> tuple[int, int]:
    from matplotlib.image import imread

    return imread(png).shape[:2]


def test_telemetry_adds_panels_and_tables(tmp_path, capsys):
    old_png, old_text = render(_write_run(tmp_path / "old", _summary()))
    png, text = render(_write_run(tmp_path / "new", _telemetry()))
    assert panels(_telemetry()) == [TIME_PER_REPLICA, SHARD_LOAD, STALENESS]
    # A second row of three panels: taller, and wider than the single loss plot.
    assert _pixels(old_png) == (420, 650)
    height, width = _pixels(png)
    assert height >= 420 + 380 and width >= 3 * 430
    # metrics.jsonl's records with replicas/shards are training records: the step table is unchanged.
    assert [r[0] for r in _rows(text)] == ["10", "20", "30", "40", "50", "60"] == [r[0] for r in _rows(old_text)]
    assert text.startswith(old_text + "\n\n")  # the telemetry comes after the table and its final line
    lines = text.splitlines()
    assert lines[lines.index("replica  task                  steps/s  compute %  data %    ps %") + 1:][:3] == [
        "0        /job:worker/task:0      300.0       70.0     1.0    20.0",
        "1        /job:worker/task:1       12.0       70.0     1.0    20.0",
        "2        /job:worker/task:2      310.0       70.0    35.0    20.0"]
    assert lines[lines.index("shard  task              busy %     MB in    MB out  dropped") + 1:][:2] == [
        "0      /job:ps/task:0      91.0      1.50      2.25       10",
        "1      /job:ps/task:1      30.0      3.00      2.25       11"]
    assert lines[-3:] == ["diagnosis:", *(f"  {f}" for f in FINDINGS)]
    # The CLI prints the same text, then the plot's path.
    assert main(["report", str(tmp_path / "new"), "--out", str(tmp_path / "cli.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-4:] == ["diagnosis:", *(f"  {f}" for f in FINDINGS), f"plot: {tmp_path / 'cli.png'}"]


def test_healthy_run_says_diagnosis_none_and_an_old_run_says_nothing(tmp_path):
    _, text = render(_write_run(tmp_path / "healthy", _telemetry(diagnosis=[])))
    assert text.splitlines()[-1] == "diagnosis: none"
    assert "replica  task" in text and "shard  task" in text
    _, old = render(_write_run(tmp_path / "old", _summary()))
    assert "diagnosis" not in old and "replica  task" not in old and "shard  task" not in old
    assert old.splitlines()[-1].startswith("final: step 60")
    # Findings alone (no per-replica or per-shard figures): the diagnosis, no tables, no panels.
    png, text = render(_write_run(tmp_path / "findings", _summary(diagnosis=FINDINGS[:1])))
    assert text.splitlines()[-2:] == ["diagnosis:", f"  {FINDINGS[0]}"] and "replica  task" not in text
    assert _pixels(png) == (420, 650)


def test_a_summary_without_telemetry_renders_exactly_as_before(tmp_path):
    """Keys that hold no figures (empty, a sync shard with nothing measured) draw no panel: the very same PNG."""
    old_png, old_text = render(_write_run(tmp_path / "old", _summary()))
    empty = _summary(replicas_stats={}, shards_stats={"0": {"task": "/job:ps/task:0", "staleness": None}})
    assert panels(empty) == [] and panels(_summary()) == [] and panels(None) == []
    png, text = render(_write_run(tmp_path / "empty", empty))
    assert png.read_bytes() == old_png.read_bytes()
    assert text == old_text + "\n\nshard  task              busy %     MB in    MB out  dropped\n" \
        "0      /job:ps/task:0         -         -         -        -"


def test_sync_run_has_no_staleness_panel(tmp_path):
    summary = _telemetry()
    for shard in summary["shards_stats"].values():
        shard["staleness"] = None
    assert panels(summary) == [TIME_PER_REPLICA, SHARD_LOAD]
    del summary["shards_stats"]
    assert panels(summary) == [TIME_PER_REPLICA]
    png, _ = render(_write_run(tmp_path, summary))
    one_panel = _pixels(png)
    png, _ = render(_write_run(tmp_path, _telemetry()))
    assert one_panel[0] > 420 and one_panel[1] < _pixels(png)[1]  # a second row, narrower than three panels


def test_staleness_buckets_are_summed_over_shards():
    assert report_panels.bucket_labels(LE) == ["0", "1", "2", "3-4", "5-8", "9-16", "17-32", ">32"]
    assert report_panels.bucket_labels([1, 3]) == ["0-1", "2-3", ">3"]
    labels, counts, mean, worst = report_panels.staleness(_telemetry())
    assert labels[3] == "3-4" and counts == [6, 102, 53, 24, 10, 6, 7, 8]
    assert mean == pytest.approx((1.0 * 180 + 2.0 * 36) / 216) and worst == 8  # weighted by pushes
    # A shard with other buckets, or a broken histogram, is left out; none left: no histogram.
    summary = _telemetry()
    summary["shards_stats"]["1"]["staleness"]["le"] = [0, 1, 2, 4, 8, 16, 64]
    assert report_panels.staleness(summary)[1] == [5, 100, 50, 20, 5, 0, 0, 0]
    summary["shards_stats"]["0"]["staleness"]["counts"] = [0] * 8
    assert report_panels.staleness(summary) is None and STALENESS not in panels(summary)


def test_panels_are_drawn_with_their_titles():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    axes = report_panels.draw(fig, _telemetry())
    assert [ax.get_title() for ax in axes] == [TIME_PER_REPLICA, SHARD_LOAD, STALENESS]
    bars = [p.get_width() for p in axes[0].patches]  # compute, then data, then ps, per replica
    assert bars == pytest.approx([0.7, 0.7, 0.7, 0.01, 0.01, 0.35, 0.2, 0.2, 0.2])
    assert [t.get_text() for t in axes[2].get_xticklabels()] == report_panels.bucket_labels(LE)
    assert report_panels.draw(Figure(), _summary()) == []


def test_malformed_telemetry_is_skipped_not_fatal(tmp_path):
    bad_hist = {"le": LE, "counts": [1, 2]}  # one count per bucket is missing
    summary = _summary(
        replicas_stats={"0": _replica(0, 300.0, 0.01), "1": None, "2": "fast", "x": {"steps_per_s": "quick"},
                        "3": {"task": 7, "compute_frac": float("nan"), "data_frac": True, "ps_s": 2.0}},
        shards_stats={"0": [1, 2], "1": {"busy_frac": "hot", "bytes_in": None, "staleness": bad_hist},
                      "2": {"busy_frac": 0.5, "dropped": "many", "staleness": {"le": [2, 1], "counts": [1, 2, 3]}},
                      "3": {"bytes_out": 4_000_000, "staleness": {"le": LE, "counts": ["a"] * 8}}},
        diagnosis=[None, 3, "", FINDINGS[0]])
    png, text = render(_write_run(tmp_path, summary))  # json writes NaN, and reads it back
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert panels(summary) == [TIME_PER_REPLICA, SHARD_LOAD]  # no valid histogram
    assert report_panels.replica_times(summary)[0] == ["0"]  # "3" has a share of nothing valid, "x" no time
    assert report_panels.shard_load(summary) == (["2", "3"], [0.5, None], [None, 4.0])
    lines = text.splitlines()
    table = _table(lines, ["replica", "task", "steps/s", "compute", "%", "data", "%", "ps", "%"])
    assert table[:3] == [
        ["0", "/job:worker/task:0", "300.0", "70.0", "1.0", "20.0"], ["3", "-", "-", "-", "-", "-"],
        ["x", "-", "-", "-", "-", "-"]]
    shards = _table(lines, ["shard", "task", "busy", "%", "MB", "in", "MB", "out", "dropped"])
    assert shards == [
        ["1", "-", "-", "-", "-", "-"], ["2", "-", "50.0", "-", "-", "-"], ["3", "-", "-", "-", "4.00", "-"]]
    assert lines[-2:] == ["diagnosis:", f"  {FINDINGS[0]}"]
    # Not a list, not a dict: nothing printed, nothing drawn.
    for junk in ("oops", None, 3, ["a"]):
        junk_summary = _summary(replicas_stats=junk, shards_stats=junk, diagnosis=junk if junk != ["a"] else "x")
        assert panels(junk_summary) == [] and report_panels.text(junk_summary) == ""


def test_one_evaluation_shows_on_the_runs_step_axis():
    """The accuracy panel shares the loss panel's step axis: a run evaluated once at step 1500 of
    3000 shows the evaluation in the middle of the run, not alone on steps 1420-1580."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from dtrain.chief.report import _draw_curves

    fig = Figure()
    FigureCanvasAgg(fig)
    train = {s: {"loss": 2.0 - s / 3000} for s in range(0, 3001, 100)}
    _draw_curves(fig, train, {1500: {"loss": 1.4, "accuracy": 0.8}}, [(1500, 0.8)])
    loss_ax, acc_ax = fig.axes
    fig.canvas.draw()
    assert acc_ax.get_xlim() == loss_ax.get_xlim()
    low, high = acc_ax.get_xlim()
    assert low <= 0 and high >= 3000
