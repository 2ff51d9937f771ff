"""What crosses the lab's links: per-host byte counters sampled over time (``LinkSampler``), and
a raw TCP transfer between two hosts that measures what a link carries (``blast``)."""

from __future__ import annotations

import bisect
import subprocess
import sys
import threading
import time
from typing import Any

from .network import Lab

# A raw TCP transfer: ``server ADDR PORT SECONDS`` receives until the sender closes, ``client ADDR
# PORT SECONDS`` sends 1 MiB buffers for SECONDS; each prints its bytes/s on its last line.
_BLAST = r"""
import socket, sys, time
mode, addr, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
buf = bytearray(1 << 20)
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen()
    print("listening", flush=True)
    c, _ = s.accept(); n = 0; t = time.perf_counter()
    while True:
        k = c.recv_into(buf)
        if not k: break
        n += k
    print(n / (time.perf_counter() - t), flush=True)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port)); break
        except OSError: time.sleep(0.05)
    n = 0; t = time.perf_counter()
    while time.perf_counter() - t < secs:
        c.sendall(buf); n += len(buf)
    c.close(); print(n / (time.perf_counter() - t), flush=True)
"""


def blast(lab: Lab, pairs: list[tuple[str, str]], seconds: float = 1.5, port: int = 5201) -> list[float]:
    """Bytes/s received over a raw TCP transfer for each (sender, receiver) pair, all at once
    (``[("a", "b"), ("b", "a")]``: both directions of one link together, full duplex)."""
    servers = []
    for i, (_, dst) in enumerate(pairs):
        h = lab[dst]
        p = h.popen([sys.executable, "-c", _BLAST, "server", h.address, str(port + i), str(seconds)],
                    stdout=subprocess.PIPE, text=True)
        servers.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
    clients = [lab[src].popen([sys.executable, "-c", _BLAST, "client", lab[dst].address, str(port + i), str(seconds)],
                              stdout=subprocess.PIPE, text=True) for i, (src, dst) in enumerate(pairs)]
    for c in clients:
        c.communicate(timeout=seconds + 30)
    return [float(s.communicate(timeout=30)[0].split()[-1]) for s in servers]


class LinkSampler:
    """Every host's link counters (bytes out of it, bytes into it) every ``period`` seconds, read
    at the bridge's end of its veth (``rx_bytes`` there is what the host sent), in the root
    namespace: no process is started in a host to read them."""

    def __init__(self, lab: Lab, period: float = 0.05):
        self.lab = lab
        self.period = period
        self.times: list[float] = []
        self.samples: list[dict[str, tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="lab-link-sampler")

    def read(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, host in self.lab.hosts.items():
            base = f"/sys/class/net/{host.veth}/statistics"
            with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
                out[name] = (int(rx.read()), int(tx.read()))
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                s = self.read()
            except OSError:  # the lab is being torn down
                return
            self.times.append(t)
            self.samples.append(s)
            self._stop.wait(self.period)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def at(self, t: float) -> dict[str, tuple[float, float]] | None:
        """The counters at wall-clock ``t``, interpolated between the samples around it."""
        i = bisect.bisect_left(self.times, t)
        if i == 0 or i >= len(self.times):
            return None
        t0, t1 = self.times[i - 1], self.times[i]
        a, b = self.samples[i - 1], self.samples[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
        return {n: (a[n][0] + w * (b[n][0] - a[n][0]), a[n][1] + w * (b[n][1] - a[n][1])) for n in a}

    def between(self, ta: float, tb: float) -> dict[str, dict[str, float]] | None:
        """{host: {"out": bytes it sent, "in": bytes it received}} between ``ta`` and ``tb``."""
        a, b = self.at(ta), self.at(tb)
        if a is None or b is None:
            return None
        return {n: {"out": b[n][0] - a[n][0], "in": b[n][1] - a[n][1]} for n in a}


def busiest(traffic: dict[str, dict[str, float]]) -> tuple[str, float]:
    """The link direction that carried the most bytes: ("ps0 in", bytes)."""
    return max(((f"{h} {d}", v) for h, dirs in traffic.items() for d, v in dirs.items()), key=lambda x: x[1])


def summarize_traffic(traffic: dict[str, dict[str, float]], samples: float, seconds: float, link_bytes_per_s: float,
                      plain_sps: float | None) -> dict[str, Any]:
    """A row's link figures: the busiest direction, its bytes per sample and utilisation, and the
    link ceiling (the ratio to plain PyTorch that link alone allows: measured rate / busiest bytes
    per sample / plain samples/s; each direction of each link has the full rate)."""
    where, nbytes = busiest(traffic)
    per_sample = nbytes / samples if samples else None
    out: dict[str, Any] = {
        "busiest_link": where, "busiest_bytes_per_sample": per_sample,
        "busiest_utilisation": nbytes / seconds / link_bytes_per_s if seconds > 0 else None,
        "total_bytes_per_sample": sum(d["out"] for d in traffic.values()) / samples if samples else None,
        "traffic": traffic,
    }
    out["link_ceiling"] = (link_bytes_per_s / per_sample / plain_sps if per_sample and plain_sps else None)
    return out
