"""benchmarks/lab_bench.py: it says why when the lab cannot be built, and (``DTRAIN_LAB_FULL=1``)
a short run measures its rows across the lab. No figure is asserted (numbers live in the
benchmark), only that each row was measured, across links, without shared memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

BENCH = ROOT / "benchmarks" / "lab_bench.py"


def test_lab_bench_without_root_says_why_and_measures_nothing(tmp_path):
    out = tmp_path / "lab.json"
    cmd = [sys.executable, str(BENCH), "--out", str(out)]
    if os.geteuid() == 0:  # root without its capabilities: a machine where the lab cannot be built (still
        if shutil.which("setpriv") is None:  # uid 0, so a checkout in a private directory stays readable)
            pytest.skip("setpriv not found: cannot drop root's capabilities to check the refusal")
        cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "the network lab cannot be built here" in proc.stderr, proc.stderr
    assert "nothing was measured" in proc.stderr and not out.exists()


@pytest.mark.lab
@pytest.mark.lab_full
@pytest.mark.timeout(420)
def test_lab_bench_measures_its_rows_across_the_lab(tmp_path):
    out = tmp_path / "lab.json"
    rows = "async_1ps_2w_bf16,ddp_gloo_2"
    proc = subprocess.run([sys.executable, str(BENCH), "--rates", "200mbit", "--only", rows, "--warmup", "25",
                           "--steps", "100", "--out", str(out)], capture_output=True, text=True, timeout=400,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    table = {r["name"]: r for r in doc["table"]}
    assert set(table) == {"plain", *rows.split(",")}
    assert all(r["status"] == "ok" and r["samples_per_sec"] > 0 for r in table.values()), table
    for name in rows.split(","):
        r = table[name]
        assert r["link_ceiling"] > 0 and r["busiest_bytes_per_sample"] > 0, r
    assert table["async_1ps_2w_bf16"]["data_plane"]["shared_memory_connections"] == 0
    assert table["async_1ps_2w_bf16"]["busiest_link"].startswith("ps0 ")  # the ps carries every push
    assert doc["leftovers"] == []
    assert out.with_suffix(".md").read_text().count("| 200mbit |") == 3
