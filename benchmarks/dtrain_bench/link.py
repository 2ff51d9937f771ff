"""``bench.py --link RATE``: every configuration across an emulated link of RATE.

The parent checks that a private network namespace with a shaped loopback can be made (``unshare
-rn``, then ``tc qdisc add dev lo root tbf``), then runs itself again inside one
(``unshare -rn python bench.py ... --link-inside``). Inside, the loopback is brought up and given a
token-bucket qdisc of RATE; every child (plain loop, DDP ranks, each dtrain run's Dask cluster and
its data-plane sockets) inherits the namespace, so every byte between processes crosses that lo.
``tbf`` shapes lo's egress, and on lo every byte is egress once: both directions of a connection
share the one RATE, which is why the achieved rates below are lo's total bytes/s against RATE.

The link itself is measured in the same run by the raw loopback round trip of ``machine.py``
(a buffer echoed by a subprocess: 2 x size / round trip) at the start and at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any

from .configs import Config
from .report import fmt_num, median

BURST, LATENCY = "256kb", "50ms"
HOST_NETNS_ENV = "DTRAIN_BENCH_HOST_NETNS"  # the parent's network namespace: inside must differ
# tc's rate units (tc(8)): bit (or none), SI and IEC multiples; "bps" units are bytes per second.
_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3, "tibit": 1024 ** 4,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
          "kibps": 8 * 1024, "mibps": 8 * 1024 ** 2, "gibps": 8 * 1024 ** 3, "tibps": 8 * 1024 ** 4}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
# Goals of issue 16 under a link (printed, never asserted).
GOAL_ASYNC_10G, GOAL_SYNC_10G, GOAL_LINK_1G, GOAL_BF16_1G = 1.5, 1.2, 0.85, 1.7


def parse_rate(text: str) -> float:
    """tc's rate syntax (``10gbit``, ``1gbit``, ``100mbit``, ``125mbps``...) -> bits per second."""
    m = _RATE.match(text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a tc rate (a number and one of: "
                         f"{', '.join(u for u in _UNITS if u)}; e.g. 10gbit, 1gbit, 100mbit)")
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    if not 1e5 <= bits <= 1e12:
        raise ValueError(f"{text!r}: the link's rate must be between 100kbit and 1tbit")
    return bits


def qdisc_args(rate: str) -> list[str]:
    return ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", BURST, "latency", LATENCY]


def probe(rate: str) -> str | None:
    """None when a private namespace with a shaped loopback can be made here, else why not."""
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH"
    script = f"ip link set lo up && {' '.join(qdisc_args(rate))} && tc qdisc show dev lo"
    try:
        proc = subprocess.run(["unshare", "-rn", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -rn failed: {exc}"
    if proc.returncode != 0 or "tbf" not in proc.stdout:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        return f"`unshare -rn` + `tc qdisc ... tbf` failed (exit {proc.returncode}): {why[-1] if why else '?'}"
    return None


def netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return "?"


def reexec(rate: str, argv: list[str], entry: str) -> int:
    """Probe, then run ``entry argv --link-inside`` in a private network namespace; its exit code."""
    why = probe(rate)
    if why:
        print(f"--link {rate}: cannot create a private network namespace with a rate-limited loopback "
              f"({why}); nothing was measured", file=sys.stderr, flush=True)
        return 2
    env = dict(os.environ, **{HOST_NETNS_ENV: netns()})
    return subprocess.call(["unshare", "-rn", sys.executable, entry, *argv, "--link-inside"], env=env)


def setup_inside(rate: str) -> tuple[str | None, str]:
    """Inside the namespace: lo up and shaped. (error or None, ``tc qdisc show dev lo``)."""
    if os.environ.get(HOST_NETNS_ENV) in (None, netns()):
        return "--link-inside must run in the private namespace bench.py --link makes (refusing to shape lo)", ""
    for cmd in (["ip", "link", "set", "lo", "up"], qdisc_args(rate)):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()}", ""
    show = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()
    if "tbf" not in show:
        return f"no tbf qdisc on lo after adding it: {show!r}", show
    return None, show


def measure_link(model_bytes: int) -> dict[str, Any]:
    """The raw round trip across the shaped lo at the model's size (at least 1 MiB, so that the
    figure is the link's rate, not its latency): bytes/s, both directions counted."""
    from .machine import loopback_rates

    size = max(model_bytes, 1 << 20)
    (r,) = loopback_rates([size], min_seconds=1.0)
    return {"bytes": size, "rtt_ms": r["rtt_ms"], "round_trips": r["round_trips"],
            "bytes_per_s": 2 * size / (r["rtt_ms"] / 1e3)}


# ------------------------------------------------------------------------------------ configurations
def link_configs(tiny: bool) -> list[Config]:
    """The rows of a ``--link`` run. Every dtrain row has ``training.shared_memory: false`` and
    ``cluster.tls: false`` (machines joined by a network, deployed with `dask scheduler` and
    `dtrain worker` as they come: plain TCP, like DDP's gloo) and no other key but the one its name
    says: ``_default`` rows are what a new user gets; ``_tls`` is the same with TLS."""
    nosh = ("training.shared_memory=false", "cluster.tls=false")

    def dt(name: str, label: str, workers: int, mode: str = "async", overlap: bool | None = None,
           sets: tuple[str, ...] = ()) -> Config:
        return Config(name, label, "dtrain", workers=workers, mode=mode, overlap=overlap, sets=(*nosh, *sets))

    plain = Config("plain", "plain PyTorch, 1 process", "plain")
    s2 = dt("sync_1ps_2w_default", "dtrain sync 1+2, defaults", 2, "sync")
    if tiny:
        return [plain, s2]
    return [plain, Config("ddp_gloo_2", "torch DDP gloo, 2 processes", "ddp", workers=2),
            dt("async_1ps_2w_default", "dtrain async 1+2, defaults", 2),
            dt("async_1ps_2w_overlap_off", "dtrain async 1+2, overlap off", 2, overlap=False),
            dt("async_1ps_1w_default", "dtrain async 1+1, defaults", 1),
            dt("async_1ps_1w_overlap_off", "dtrain async 1+1, overlap off", 1, overlap=False),
            s2,
            dt("sync_1ps_2w_whole", "dtrain sync 1+2, whole push", 2, "sync", sets=("training.bucket_mb=0",)),
            dt("sync_1ps_2w_bf16", "dtrain sync 1+2, bf16 wire", 2, "sync", sets=("training.wire_dtype=bfloat16",)),
            dt("sync_1ps_2w_tls", "dtrain sync 1+2, TLS", 2, "sync", sets=("cluster.tls=true",))]


# ------------------------------------------------------------------------------------ summary and printing
def annotate(results: dict[str, dict[str, Any]], runs: list[dict[str, Any]], link: dict[str, Any]) -> None:
    """Per row: lo's bytes/s over the timed window (median over reps), that over the link's
    measured rate (``link_fraction``), the bytes each trained sample moved across lo
    (``lo_bytes_per_sample``) and the ratio to plain PyTorch that the link alone allows at those
    bytes per sample (``link_ceiling``: the measured rate / bytes per sample / the plain loop's
    samples/s of the same repetition; the medians over repetitions). A goal above its row's
    ceiling cannot be met on this link, whatever the CPUs do."""
    rate = link.get("bytes_per_s")
    plain = {x["rep"]: x["samples_per_sec"] for x in runs if x["config"] == "plain" and x.get("status") == "ok"}
    for name, r in results.items():
        ok = [x for x in runs if x["config"] == name and x.get("status") == "ok" and x.get("lo_bytes_per_sec")]
        r["lo_bytes_per_sec"] = median([x["lo_bytes_per_sec"] for x in ok])
        r["link_fraction"] = r["lo_bytes_per_sec"] / rate if rate and r["lo_bytes_per_sec"] else None
        per_sample = [(x["rep"], x["lo_bytes_per_sec"] / x["samples_per_sec"]) for x in ok if x.get("samples_per_sec")]
        r["lo_bytes_per_sample"] = median([b for _, b in per_sample])
        r["link_ceiling"] = median([rate / b / plain[rep] for rep, b in per_sample if rate and rep in plain])


def _pair_ratio(runs: list[dict[str, Any]], a: str, b: str) -> float | None:
    """Median over repetitions of samples/s of ``a`` over ``b`` in the same repetition."""
    ok = {(r["config"], r["rep"]): r["samples_per_sec"] for r in runs if r.get("status") == "ok"}
    return median([ok[(a, rep)] / ok[(b, rep)] for c, rep in ok if c == a and (b, rep) in ok])


def goals(results: dict[str, dict[str, Any]], runs: list[dict[str, Any]], rate_bits: float) -> list[dict[str, Any]]:
    """Issue 16's goals under a link; each with the rate the issue states it at."""
    def ratio(name: str) -> float | None:
        return (results.get(name) or {}).get("ratio")

    defaults = [n for n in ("async_1ps_2w_default", "sync_1ps_2w_default") if results.get(n, {}).get("samples_per_sec")]
    frac = max(((results[n].get("link_fraction") or 0, n) for n in defaults), default=(None, None))
    best = max(((results[n]["samples_per_sec"], n) for n in defaults), default=(None, None))
    ddp = (results.get("ddp_gloo_2") or {}).get("samples_per_sec")
    def ceiling(name: str) -> str:
        c = (results.get(name) or {}).get("link_ceiling")
        return "" if c is None else f"this link allows at most {c:.2f} at this row's bytes per sample"

    ddp_ceiling = (results.get("ddp_gloo_2") or {}).get("link_ceiling")
    best_ceiling = (results.get(best[1]) or {}).get("link_ceiling") if best[1] else None
    rows = [
        ("async 1+2 (defaults) / plain", 10e9, ratio("async_1ps_2w_default"), GOAL_ASYNC_10G,
         ceiling("async_1ps_2w_default")),
        ("sync 1+2 (defaults) / plain", 10e9, ratio("sync_1ps_2w_default"), GOAL_SYNC_10G,
         ceiling("sync_1ps_2w_default")),
        ("data plane's rate / link's measured rate", 1e9, frac[0] or None, GOAL_LINK_1G, f"best default row: {frac[1]}"),
        ("sync 1+2 bf16 / sync 1+2 float32 (defaults)", 1e9, _pair_ratio(runs, "sync_1ps_2w_bf16", "sync_1ps_2w_default"),
         GOAL_BF16_1G, "same repetition"),
        ("best default dtrain / DDP gloo", None, best[0] / ddp if best[0] and ddp else None, 1.0,
         (f"{best[1]}" if best[1] else "") + (f"; the link allows at most {best_ceiling / ddp_ceiling:.2f} "
                                               "(the two rows' link ceilings)" if best_ceiling and ddp_ceiling else "")),
    ]
    out = []
    for what, at, value, goal, note in rows:
        out.append({"goal": what, "stated_at_bits": at, "value": value, "target": goal, "note": note,
                    "applies": at is None or abs(at - rate_bits) < 1e-6 * at,
                    "met": None if value is None else (value > goal if at is None else value >= goal)})
    return out


def print_link(results: dict[str, dict[str, Any]], link: dict[str, Any]) -> None:
    print()
    h = f"{'bytes on the shaped lo':<38} {'MB/s':>9} {'% of link':>10} {'KB/sample':>10} {'link ceiling':>13}"
    print(h)
    print("-" * len(h))
    for r in results.values():
        if r.get("lo_bytes_per_sec"):
            pct = "–" if r.get("link_fraction") is None else f"{100 * r['link_fraction']:.0f}%"
            per = "–" if r.get("lo_bytes_per_sample") is None else f"{r['lo_bytes_per_sample'] / 1e3:,.1f}"
            cap = "–" if r.get("link_ceiling") is None else f"{r['link_ceiling']:.2f}"
            print(f"{r['label']:<38} {fmt_num(r['lo_bytes_per_sec'] / 1e6, ',.1f'):>9} {pct:>10} {per:>10} {cap:>13}")
    print(f"MB/s: lo's byte counter (inside the namespace only this benchmark's traffic; both directions, as tbf "
          f"shapes them together): dtrain, the median bytes per global step over the summary intervals after the "
          f"warm-up x the run's global steps/s; DDP, between its barriers. % of link: that over the link's measured rate "
          f"({link['bytes_per_s'] / 1e6:,.1f} MB/s). KB/sample: those bytes per trained sample. link ceiling: the "
          f"ratio to plain PyTorch that the link alone allows at those bytes per sample (its measured rate / bytes "
          f"per sample / the plain loop's samples/s): a row cannot go faster on this link, whatever the CPUs do.")
    print()
    print(f"issue 16's goals under a link (this run: {link['rate']}; nothing is asserted):")
    for g in link["goals"]:
        at = "any rate" if g["stated_at_bits"] is None else f"{g['stated_at_bits'] / 1e9:g} Gbit/s"
        val = "–" if g["value"] is None else f"{g['value']:.2f}"
        state = "–" if g["met"] is None else ("met" if g["met"] else "MISSED")
        if not g["applies"]:
            state += f" (the goal is stated at {at}; for reference)"
        cmp_ = ">" if g["stated_at_bits"] is None else ">="
        note = f"  [{g['note']}]" if g["note"] else ""
        print(f"  {g['goal']:<45} {val:>6}  {cmp_} {g['target']:.2f}  {state}{note}")


def header_line(link: dict[str, Any]) -> str:
    raw = link.get("raw") or []
    each = ", ".join(f"{x['bytes_per_s'] / 1e6:,.1f}" for x in raw)
    return (f"  link: lo in a private network namespace, tbf rate {link['rate']} ({link['rate_bits'] / 8e6:,.1f} MB/s) "
            f"burst {BURST} latency {LATENCY}; measured {link['bytes_per_s'] / 1e6:,.1f} MB/s "
            f"({100 * link['bytes_per_s'] * 8 / link['rate_bits']:.0f}% of the rate; raw round trip of "
            f"{link['raw'][0]['bytes'] / 1e6:.2f} MB, start/end: {each} MB/s); dtrain: shared_memory false")
