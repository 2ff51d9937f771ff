"""dtrain's scheduler plugin (dtrain/observe/scheduler.py) on a real in-process Dask scheduler: a
payload logged on the telemetry topic appears as ``dtrain_*`` series on the scheduler's own
``/metrics``, as the ``/dtrain`` page (with bokehjs served offline) and as ``/dtrain/data.json``.
Beside them, the pure parts without HTTP: ``families`` (dtrain/observe/prometheus.py), the task
parsing, the staleness bars and the page's address."""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
import uuid
from urllib.parse import urljoin

import pytest
from distributed import Client, LocalCluster
from prometheus_client.parser import text_string_to_metric_families

from dtrain.deploy.plugin import register as register_plugin
from dtrain.observe.dashboard import EMPTY, render_page, staleness_bars
from dtrain.observe.prometheus import families, parse_task
from dtrain.observe.scheduler import TOPIC, TelemetryPlugin, _register_collector, page_link

TITLES = ("Per-shard load", "Per-shard bytes", "Time per replica", "Replica step rate", "Staleness")
LE = [0, 1, 2, 4, 8, 16, 32]
COUNTS = [5, 100, 50, 20, 5, 0, 0, 3]  # the last bucket: above 32


def register(client) -> bool:
    return register_plugin(client, TelemetryPlugin(), "no dtrain_* series")


def payload(run: str, step: int = 1200) -> dict:
    """Two replicas, two shards: shard 0 with a staleness histogram, shard 1 without (as in a sync run)."""
    return {
        "run": run, "name": "digits", "time": time.time(), "step": step, "steps": 3000, "loss": 0.21,
        "replicas": {
            "0": {"task": "/job:worker/task:0", "steps": 600, "steps_per_s": 410.0, "compute_s": 1.25,
                  "data_s": 0.01, "ps_s": 0.3, "compute_frac": 0.7, "data_frac": 0.01, "ps_frac": 0.2,
                  "bytes_sent": 123456, "bytes_recv": 654321},
            "1": {"task": "/job:worker/task:1", "steps": 250, "steps_per_s": 120.0, "compute_s": 0.5,
                  "data_s": 0.75, "ps_s": 0.125, "compute_frac": 0.3, "data_frac": 0.5, "ps_frac": 0.1,
                  "bytes_sent": 5000, "bytes_recv": 6000},
        },
        "shards": {
            "0": {"task": "/job:ps/task:0", "variables": ["0.weight", "0.bias"], "pushes": 1200, "applies": 1190,
                  "applies_per_s": 800.0, "busy_frac": 0.3, "bytes_in": 1000, "bytes_out": 2000, "dropped": 10,
                  "staleness": {"le": LE, "counts": COUNTS, "mean": 1.5, "max": 40,
                                "loss": [0.2, 0.21, None, 0.3, None, None, None, 0.5]}},
            "1": {"task": "/job:ps/task:1", "variables": ["2.weight"], "pushes": 1100, "applies": 1100,
                  "applies_per_s": 700.0, "busy_frac": 0.85, "bytes_in": 3000, "bytes_out": 4000, "dropped": 0,
                  "staleness": None},
        },
        "diagnosis": ["hot shard: shard 1 <ps:1> busy 85%", "straggler: replica 1 & co"],
    }


# -- pure --------------------------------------------------------------------------------------

def test_task_strings_parse_to_job_and_index():
    assert parse_task("/job:worker/task:1") == ("worker", "1")
    assert parse_task("/job:ps/task:12") == ("ps", "12")
    assert parse_task("/job:worker/replica:0/task:3") == ("worker", "3")
    assert parse_task("/job:chief") == ("chief", "")
    assert parse_task(None) == ("", "")
    assert parse_task("") == ("", "")
    assert parse_task(7) == ("", "")


def samples(fams) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}``, failing on a label set that appears twice in a series."""
    out: dict[tuple[str, frozenset], float] = {}
    for fam in fams:
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def labels(**kw: str) -> frozenset:
    return frozenset(kw.items())


def test_families_name_label_and_value_every_figure():
    fams = families({"r": payload("r")})
    kinds = {f.name: f.type for f in fams}
    assert kinds == {
        "dtrain_global_step": "gauge", "dtrain_loss": "gauge", "dtrain_findings": "gauge",
        "dtrain_replica_steps": "counter", "dtrain_replica_steps_per_second": "gauge",
        "dtrain_replica_seconds": "counter", "dtrain_replica_bytes_sent": "counter",
        "dtrain_replica_bytes_received": "counter", "dtrain_shard_pushes": "counter",
        "dtrain_shard_applies": "counter", "dtrain_shard_dropped": "counter",
        "dtrain_shard_applies_per_second": "gauge", "dtrain_shard_busy_ratio": "gauge",
        "dtrain_shard_bytes_in": "counter", "dtrain_shard_bytes_out": "counter",
        "dtrain_shard_staleness": "histogram"}
    got = samples(fams)
    r1 = dict(run="r", job="worker", task="1", replica="1")
    assert got["dtrain_global_step", labels(run="r", name="digits")] == 1200
    assert got["dtrain_findings", labels(run="r", name="digits")] == 2
    assert got["dtrain_replica_steps_total", labels(**r1)] == 250
    assert got["dtrain_replica_bytes_received_total", labels(**r1)] == 6000
    assert {p: got["dtrain_replica_seconds_total", labels(**r1, phase=p)] for p in ("compute", "data", "ps")} \
        == {"compute": 0.5, "data": 0.75, "ps": 0.125}
    s1 = dict(run="r", job="ps", task="1", shard="1")
    assert got["dtrain_shard_busy_ratio", labels(**s1)] == 0.85
    assert got["dtrain_shard_dropped_total", labels(run="r", job="ps", task="0", shard="0")] == 10
    assert not [k for k in got if k[0].startswith("dtrain_shard_staleness") and ("shard", "1") in k[1]]
    buckets = [got["dtrain_shard_staleness_bucket", labels(run="r", job="ps", task="0", shard="0", le=le)]
               for le in ["0.0", "1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "+Inf"]]
    assert buckets == [5, 105, 155, 175, 180, 180, 180, 183]
    assert got["dtrain_shard_staleness_sum", labels(run="r", job="ps", task="0", shard="0")] == 1.5 * 183


def test_families_skip_missing_figures_and_malformed_parts():
    p = payload("r")
    p["loss"] = None
    del p["replicas"]["0"]["steps"]
    p["replicas"]["2"] = "not a table"
    p["shards"]["0"]["staleness"] = {"le": [0, 1], "counts": [1]}  # too few counts: the histogram goes
    got = samples(families({"r": p, "bad": {"run": "bad", "replicas": "x", "shards": [1], "step": 5},
                            "worse": "x"}))
    assert not [k for k in got if k[0] == "dtrain_loss"]
    assert ("dtrain_replica_steps_total", labels(run="r", job="worker", task="0", replica="0")) not in got
    assert got["dtrain_replica_steps_per_second", labels(run="r", job="worker", task="0", replica="0")] == 410
    assert not [k for k in got if ("replica", "2") in k[1]]
    assert not [k for k in got if k[0].startswith("dtrain_shard_staleness")]
    assert got["dtrain_shard_pushes_total", labels(run="r", job="ps", task="0", shard="0")] == 1200
    assert {dict(k[1])["run"] for k in got} == {"r", "bad"}  # the bad run keeps its well-formed step
    assert got["dtrain_global_step", labels(run="bad", name="")] == 5


def test_staleness_bars_sum_over_shards_with_the_same_buckets():
    p = payload("r")
    p["shards"]["1"]["staleness"] = {"le": LE, "counts": [1] * 8, "loss": [0.4] + [None] * 7}
    p["shards"]["2"] = {"staleness": {"le": [0, 5], "counts": [9, 9, 9]}}  # other buckets: left out
    labels_, counts, loss = staleness_bars(p)
    assert labels_ == ["≤0", "≤1", "≤2", "≤4", "≤8", "≤16", "≤32", ">32"]
    assert counts == [c + 1 for c in COUNTS]
    assert loss[0] == pytest.approx((0.2 * 5 + 0.4) / 6) and loss[1] == pytest.approx(0.21)
    assert staleness_bars({"shards": {"0": {"staleness": None}}}) is None


def test_page_without_runs_and_page_link():
    page = render_page({})
    assert EMPTY in page and "<title>dtrain</title>" in page
    assert 'fetch("dtrain/live.json"' in page  # it polls its feed, and reloads once a run reports
    assert page_link("http://127.0.0.1:8787/status") == "http://127.0.0.1:8787/dtrain"
    assert page_link("https://host/proxy/8787/status?x=1") == "https://host/proxy/8787/dtrain"
    assert page_link("http://host:8787") == "http://host:8787/dtrain"
    assert page_link(None) is None and page_link("") is None


# -- on a scheduler ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dask_client():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp", host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        assert register(client)
        yield client


def get(client: Client, path: str) -> tuple[int, str, str]:
    url = urljoin(client.dashboard_link, path)
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")


def metrics(client: Client) -> dict[tuple[str, frozenset], float]:
    return samples(text_string_to_metric_families(get(client, "/metrics")[2]))


def wait_for_run(client: Client, run: str, timeout: float = 5.0) -> dict[tuple[str, frozenset], float]:
    """The scrape once it has the run (``log_event`` reaches the scheduler asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        got = metrics(client)
        if ("dtrain_global_step", labels(run=run, name="digits")) in got:
            return got
        assert time.monotonic() < deadline, f"run {run!r} not on /metrics within {timeout:g} s"
        time.sleep(0.05)


def series_of(got: dict, run: str, name: str) -> dict[frozenset, float]:
    return {k[1]: v for k, v in got.items() if k[0] == name and ("run", run) in k[1]}


def test_metrics_carry_every_replica_and_shard(dask_client):
    run = f"digits-{uuid.uuid4().hex[:8]}"
    p = payload(run)
    dask_client.log_event(TOPIC, p)
    _register_collector()  # a second scheduler in this process: still one collector, no duplicate series
    got = wait_for_run(dask_client, run)
    for i, r in p["replicas"].items():
        lab = dict(run=run, job="worker", task=i, replica=i)
        assert got["dtrain_replica_steps_total", labels(**lab)] == r["steps"]
        assert got["dtrain_replica_steps_per_second", labels(**lab)] == r["steps_per_s"]
        assert got["dtrain_replica_bytes_sent_total", labels(**lab)] == r["bytes_sent"]
        assert got["dtrain_replica_seconds_total", labels(**lab, phase="data")] == r["data_s"]
    assert len(series_of(got, run, "dtrain_replica_steps_total")) == len(p["replicas"])
    assert len(series_of(got, run, "dtrain_replica_seconds_total")) == 3 * len(p["replicas"])
    for i, s in p["shards"].items():
        lab = dict(run=run, job="ps", task=i, shard=i)
        assert got["dtrain_shard_busy_ratio", labels(**lab)] == s["busy_frac"]
        assert got["dtrain_shard_applies_total", labels(**lab)] == s["applies"]
        assert got["dtrain_shard_bytes_out_total", labels(**lab)] == s["bytes_out"]
    assert len(series_of(got, run, "dtrain_shard_pushes_total")) == len(p["shards"])
    assert got["dtrain_loss", labels(run=run, name="digits")] == p["loss"]
    assert got["dtrain_findings", labels(run=run, name="digits")] == len(p["diagnosis"])  # a list sent is a tuple received
    buckets = series_of(got, run, "dtrain_shard_staleness_bucket")
    assert {dict(k)["shard"] for k in buckets} == {"0"}  # shard 1 has no staleness
    values = [v for _, v in sorted((float(dict(k)["le"]), v) for k, v in buckets.items())]
    assert values == sorted(values) and len(values) == len(LE) + 1  # cumulative
    assert values[-1] == sum(COUNTS) == series_of(got, run, "dtrain_shard_staleness_count")[
        labels(run=run, job="ps", task="0", shard="0")]


def test_page_and_json(dask_client):
    run = f"page-{uuid.uuid4().hex[:8]}<i>"
    p = payload(run)
    dask_client.log_event(TOPIC, p)
    wait_for_run(dask_client, run)
    status, ctype, page = get(dask_client, "/dtrain")
    assert status == 200 and ctype.startswith("text/html")
    for title in TITLES:
        assert f'"{title}"' in page, title  # in the plots' document
    assert "<i>" not in page and "&lt;i&gt;" in page  # the run name, escaped
    assert "hot shard: shard 1 &lt;ps:1&gt; busy 85%" in page and "replica 1 &amp; co" in page
    src = re.findall(r'<script src="([^"]+)"', page)
    assert [s for s in src if s.endswith("/js/bokeh.min.js")], src
    for s in src:
        assert urljoin("/dtrain", s).startswith("/dtrain/static/js/"), s  # served here: no CDN
        status, ctype, js = get(dask_client, urljoin("/dtrain", s))
        assert status == 200 and "javascript" in ctype and len(js) > 10_000, s
    status, ctype, body = get(dask_client, "/dtrain/data.json")
    assert status == 200 and ctype.startswith("application/json")
    assert json.loads(body)["runs"][run] == p


def test_a_second_run_adds_series_and_registering_again_keeps_them(dask_client):
    first, second = (f"run-{uuid.uuid4().hex[:8]}" for _ in range(2))
    dask_client.log_event(TOPIC, payload(first, step=10))
    wait_for_run(dask_client, first)
    assert register(dask_client)  # a second chief on the same scheduler
    dask_client.log_event(TOPIC, payload(second, step=20))
    got = wait_for_run(dask_client, second)
    assert got["dtrain_global_step", labels(run=first, name="digits")] == 10
    assert got["dtrain_global_step", labels(run=second, name="digits")] == 20
    assert len(series_of(got, first, "dtrain_replica_steps_total")) == 2
    assert {first, second} <= set(json.loads(get(dask_client, "/dtrain/data.json")[2])["runs"])


def test_malformed_payloads_leave_the_endpoints_answering(dask_client):
    bad, good = f"bad-{uuid.uuid4().hex[:8]}", f"good-{uuid.uuid4().hex[:8]}"
    dask_client.log_event(TOPIC, {"run": bad, "step": 7, "replicas": "x", "shards": {"0": "y"},
                                  "diagnosis": "not a list", "time": "soon"})
    dask_client.log_event(TOPIC, "no run at all")
    dask_client.log_event(TOPIC, {"replicas": {}})
    dask_client.log_event(TOPIC, payload(good))  # events arrive in order: once this is in, so are the bad ones
    got = wait_for_run(dask_client, good)
    assert got["dtrain_global_step", labels(run=bad, name="")] == 7
    assert not [k for k in got if ("run", bad) in k[1] and k[0] != "dtrain_global_step"]
    assert len(series_of(got, good, "dtrain_replica_steps_total")) == 2
    status, _, page = get(dask_client, "/dtrain")
    assert status == 200 and bad in page and '"Per-shard load"' in page
    assert bad in json.loads(get(dask_client, "/dtrain/data.json")[2])["runs"]


def test_register_says_when_the_scheduler_refuses(dask_client, caplog):
    client = Client(dask_client.scheduler.address, set_as_default=False)
    client.close()
    with caplog.at_level(logging.WARNING, logger="dtrain.deploy.plugin"):
        assert register(client) is False
    assert "install dtrain where the scheduler runs" in caplog.text


def test_a_shards_tables_become_table_series():
    p = payload("r")
    p["shards"]["1"]["tables"] = {"tables.C2.weight": {"live_rows": 41, "bytes": 9000, "admitted": 50, "evicted": 9,
                                                       "rejected": 3, "capacity": 64},
                                  "tables.C1.weight": {"live_rows": 500, "bytes": 32000}}
    fams = families({"r": p})
    kinds = {f.name: f.type for f in fams}
    assert {k: v for k, v in kinds.items() if k.startswith("dtrain_table")} == {
        "dtrain_table_rows": "gauge", "dtrain_table_bytes": "gauge", "dtrain_table_admitted": "counter",
        "dtrain_table_evicted": "counter", "dtrain_table_rejected": "counter"}
    got = samples(fams)
    s1 = dict(run="r", job="ps", task="1", shard="1")
    assert got["dtrain_table_rows", labels(**s1, table="C2")] == 41
    assert got["dtrain_table_evicted_total", labels(**s1, table="C2")] == 9
    assert got["dtrain_table_bytes", labels(**s1, table="C1")] == 32000
    assert not [k for k in got if k[0] == "dtrain_table_admitted_total" and ("table", "C1") in k[1]]


def test_the_page_sums_each_tables_parts_and_draws_them():
    from dtrain.observe.dashboard import table_figures

    p = payload("r")
    p["shards"]["0"]["tables"] = {"tables.C2.weight": {"live_rows": 40, "admitted": 50, "evicted": 10, "bytes": 100},
                                  "tables.C1.weight": {"live_rows": 7, "bytes": 20}}
    p["shards"]["1"]["tables"] = {"tables.C2.weight": {"live_rows": 2, "admitted": 3, "evicted": 1, "bytes": 5,
                                                       "rejected": None}, "junk": "x"}
    figures = table_figures(p)
    assert figures == {"C2": {"live_rows": 42, "admitted": 53, "evicted": 11, "bytes": 105},
                       "C1": {"live_rows": 7, "bytes": 20}}
    assert table_figures(payload("r")) == {}  # no tables: no panel
    page = render_page({"r": p})
    assert "Table rows (all ps tasks)" in page and "Table rows" not in render_page({"r": payload("r")})


# -- the page's feed and the runs' history ------------------------------------------------------

def wait_for_points(client: Client, run: str, n: int, timeout: float = 5.0) -> dict:
    """``/dtrain/data.json``'s history of ``run`` once it has ``n`` points."""
    deadline = time.monotonic() + timeout
    while True:
        history = json.loads(get(client, "/dtrain/data.json")[2]).get("history", {}).get(run)
        if history is not None and len(history["t"]) >= n:
            return history
        assert time.monotonic() < deadline, f"run {run!r} has no {n} points within {timeout:g} s"
        time.sleep(0.05)


def feed(client: Client) -> dict:
    status, ctype, body = get(client, "/dtrain/live.json")
    assert status == 200 and ctype.startswith("application/json")
    return json.loads(body)


def test_the_feed_follows_a_run_and_its_shape_holds_until_a_replica_joins(dask_client):
    from dtrain.observe.dashboard import run_key

    run = f"digits-{uuid.uuid4().hex[:8]}"
    worker, info = next(iter(dask_client.scheduler_info()["workers"].items()))
    t0 = time.time()
    for i in range(3):
        p = payload(run, step=100 * i)
        p.update(time=t0 + 2 * i, started=t0 - 1, loss=1.0 / (i + 1), hosts={"/job:ps/task:0": worker})
        dask_client.log_event(TOPIC, p)
    history = wait_for_points(dask_client, run, 3)
    assert history["t"] == [1.0, 3.0, 5.0] and history["steps_per_s"] == [None, 50.0, 50.0]
    first = feed(dask_client)
    key = run_key(run)
    ts = first["sources"][f"{key}/ts"]
    assert ts["loss"] == [1.0, 0.5, pytest.approx(1 / 3)] and ts["step"] == [0, 100, 200]
    assert first["sources"][f"{key}/replica_ts"]["y1"] == [120.0] * 3  # replica 1's step rate over time
    memory = first["sources"][f"{key}/memory"]  # the ps task's worker, as the scheduler knows it
    assert memory["task"] == ["/job:ps/task:0"] and memory["used"][0] > 0
    assert memory["limit"] == [info["memory_limit"]]
    assert "hot shard: shard 1 &lt;ps:1&gt; busy 85%" in first["text"][f"{key}-findings"]
    page = get(dask_client, "/dtrain")[2]
    assert f"const shape = {json.dumps(first['shape'])}" in page  # drawn for what the feed serves
    p = payload(run, step=300)
    p.update(time=t0 + 6, started=t0 - 1, loss=0.2)
    dask_client.log_event(TOPIC, p)
    wait_for_points(dask_client, run, 4)
    second = feed(dask_client)
    assert second["shape"] == first["shape"]  # new figures, same page: updated in place
    assert second["sources"][f"{key}/ts"]["loss"][-1] == 0.2
    p = payload(run, step=400)
    p["replicas"]["2"] = dict(p["replicas"]["1"])
    p.update(time=t0 + 8, started=t0 - 1)
    dask_client.log_event(TOPIC, p)
    wait_for_points(dask_client, run, 5)
    third = feed(dask_client)
    assert third["shape"] != first["shape"]  # a replica joined: the page reloads for its bars
    assert third["sources"][f"{key}/replica_ts"]["y2"] == [None] * 4 + [120.0]


def test_two_runs_of_one_pipeline_keep_their_own_figures(dask_client):
    from dtrain.observe.dashboard import run_key

    runs = [f"digits-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    t0 = time.time() + 1000  # the newest runs on the scheduler: both drawn
    for i, loss in ((0, 0.9), (1, 0.1)):
        for k in range(2):
            p = payload(runs[i], step=10 * k)
            p.update(time=t0 + k, started=t0 + i, loss=loss)
            dask_client.log_event(TOPIC, p)
    for run in runs:
        wait_for_points(dask_client, run, 2)
    got = feed(dask_client)
    assert got["sources"][f"{run_key(runs[0])}/ts"]["loss"] == [0.9, 0.9]
    assert got["sources"][f"{run_key(runs[1])}/ts"]["loss"] == [0.1, 0.1]
    heads = [got["text"][f"{run_key(r)}-head"] for r in runs]
    assert all(h.startswith("<h2>digits <small>run ") for h in heads)  # one name, told apart by the id
    order = [k for k in got["text"] if k.endswith("-head")]
    assert order.index(f"{run_key(runs[1])}-head") < order.index(f"{run_key(runs[0])}-head")  # the newest first
