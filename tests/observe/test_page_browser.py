"""The ``/dtrain`` page as a user sees it: headless Chromium (tests.helpers.browser) opens it
during a real run on the embedded cluster, one of whose three replicas is slowed, and the test
checks what the browser shows: the panels (their titles, laid out within a 1280-pixel window
with no horizontal scrollbar), a loss series of several points fed in place by the page's feed,
the findings naming the slowed replica, and no request to an address outside the cluster. A
screenshot of the page is kept in ``build/test-artifacts/`` (or ``$DTRAIN_TEST_ARTIFACTS``)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import dtrain
from tests.helpers.browser import INSTALL, find_chromium
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.browser

STRAGGLER = "straggler: replica 2 (/job:worker/task:2)"
TITLES = {"Loss", "Global steps per second", "Samples per second", "Replica step rate over time",
          "Per-shard busy share over time", "Memory per ps task over time", "Per-shard load", "Per-shard bytes",
          "Time per replica", "Replica step rate", "Staleness", "Memory per task"}


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = find_chromium()  # installs Debian's package where it is missing and this user may
    if binary is None:
        if os.environ.get("DTRAIN_REQUIRE_BROWSER"):
            pytest.fail(f"no Chromium, and DTRAIN_REQUIRE_BROWSER is set (CI): {INSTALL}")
        pytest.skip(f"no Chromium: {INSTALL} (make test does it as root)")
    return binary


def artifacts() -> Path:
    return Path(os.environ.get("DTRAIN_TEST_ARTIFACTS") or ROOT / "build" / "test-artifacts")


def test_the_page_in_a_browser_during_a_run(chromium, tmp_path):
    seen, shot = tmp_path / "page.json", artifacts() / "dtrain-page.png"
    shot.unlink(missing_ok=True)
    spec = dtrain.loads(f"""
name: browser
cluster: {{jobs: {{ps: 2, worker: 3}}}}
model: {{module: "tests.helpers.slowmodels:SlowMLP", kwargs: {{delay_s: 0.03, fast_delay_s: 0.003,
        slow_worker: worker-2}}}}
data: {{source: sklearn:digits, batch_size: 32}}
optimizer: {{name: sgd, lr: 0.05}}
training: {{mode: async, steps: 100000}}
summary: {{every_steps: 20, tensorboard: false}}
observe: {{interval_s: 0.5}}
hooks: [{{type: "tests.helpers.observe:PageCheckHook", args: {{path: {str(seen)!r}, shot: {str(shot)!r},
         finding: {STRAGGLER!r}}}}}]
""")
    result = dtrain.run(spec, run_dir=tmp_path / "run", processes=False)
    assert result.summary["status"] == "completed"
    out = json.loads(seen.read_text())
    assert "error" not in out, out
    state = out["state"]
    # The panels, each drawn at a readable size inside the window.
    titles = [f["title"] for f in state["figures"]]
    assert TITLES <= set(titles), sorted(titles)
    assert len(titles) == len(set(titles)), titles  # one run on the page: each panel once
    for f in state["figures"]:
        assert f["width"] >= 300 and f["height"] >= 200 and 0 <= f["left"] and f["right"] <= state["inner_width"], f
    assert state["inner_width"] == 1280 and state["scroll_width"] <= state["client_width"], state
    # The loss over time as the browser holds it, and the findings as shown.
    assert len(state["loss"]) >= 2, state["loss"]
    assert STRAGGLER in state["findings"], state["findings"]
    assert out["errors"] == []  # no script error on the page
    # Everything the page loaded came from the scheduler (data: URLs are Bokeh's own icons).
    dashboard = urlsplit(out["requests"][0])
    assert dashboard.hostname == "127.0.0.1" and dashboard.path == "/dtrain", out["requests"][0]
    outside = [u for u in out["requests"]
               if not u.startswith("data:") and urlsplit(u).netloc != dashboard.netloc]
    assert not outside, outside
    assert any(urlsplit(u).path == "/dtrain/live.json" for u in out["requests"])
    assert out["fed_in_place"]  # the loss grew on the open page, without a reload
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">I", png[16:20])[0] == 1280
