"""``dtrain.chief.report.render``: a run's curves to a PNG and a short table (on a real in-process run,
and on hand-written metrics files for the edge cases)."""

from __future__ import annotations

import json
import re

import pytest

import dtrain
from dtrain.chief.report import MAX_ROWS, render
from dtrain.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SPEC = """
name: report-run
cluster: {jobs: {ps: 1, worker: 2}}
model:
  input_shape: [64]
  layers: [{type: linear, out: 16}, {type: relu}, {type: linear, out: 10}]
data: {source: sklearn:digits, batch_size: 16}
optimizer: {name: sgd, lr: 0.1}
training: {mode: sync, steps: 60}
summary: {every_steps: 10, tensorboard: false}
eval: {every_steps: 20}
"""


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if re.match(r"^\s+\d+\s", line)]


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
    final = text.splitlines()[-1]
    assert final.startswith("final: step 60") and "status completed" in final
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
