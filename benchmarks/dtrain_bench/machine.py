"""The machine itself: its description, the loopback byte counter and per-process CPU sampler,
and the raw loopback TCP round trip (an echo-server child and the client that times it)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .configs import ENTRY


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "hostname": platform.node(), "loadavg_start": loadavg(),
    }
    with contextlib.suppress(Exception):
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(Exception):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(Exception):
        info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from importlib import metadata

    for pkg in ("torch", "dask", "distributed", "numpy", "dtrain", "psutil", "matplotlib"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------ sampling during a run
LOOP = "/loop"  # suffix of a ps process's event-loop thread in the CPU samples


class LoopbackSampler(threading.Thread):
    """Samples the loopback interface's byte counter (machine-wide) every 20 ms, and the CPU time
    (user + system) of the given processes every 100 ms (a ps's event-loop thread also alone:
    name + LOOP; the rest of a ps's CPU is its data-plane connection threads')."""

    def __init__(self, pids: dict[str, int] | None = None) -> None:
        super().__init__(daemon=True, name="bench-lo-sampler")
        self.samples: list[tuple[float, int]] = []
        self.cpu_samples: list[tuple[float, dict[str, float]]] = []
        self.pids = pids or {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        procs = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(psutil.Error):
                procs[name] = psutil.Process(pid)
        n = 0
        while not self._stop_event.is_set():
            lo = psutil.net_io_counters(pernic=True).get("lo")
            if lo is None:
                return
            self.samples.append((time.time(), lo.bytes_sent))
            if procs and n % 5 == 0:
                cpu = {}
                for name, proc in procs.items():
                    with contextlib.suppress(psutil.Error):
                        cpu[name] = sum(proc.cpu_times()[:2])
                        if proc.pid == os.getpid():  # the chief: not this sampling thread's own time
                            cpu[name] -= time.thread_time()
                        if name.startswith("ps-"):  # its main thread: the Dask worker's event loop
                            main = [t for t in proc.threads() if t.id == proc.pid]
                            if main:
                                cpu[name + LOOP] = main[0].user_time + main[0].system_time
                self.cpu_samples.append((time.time(), cpu))
            n += 1
            self._stop_event.wait(0.02)

    def cpu_between(self, ta: float, tb: float) -> dict[str, float] | None:
        """CPU seconds each process used between the samples nearest ``ta`` and ``tb``."""
        s = self.cpu_samples
        if len(s) < 2:
            return None
        a = min(s, key=lambda x: abs(x[0] - ta))
        b = min(s, key=lambda x: abs(x[0] - tb))
        if b[0] <= a[0]:
            return None
        return {n: (b[1][n] - a[1][n]) * (tb - ta) / (b[0] - a[0]) for n in a[1] if n in b[1]}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)

    def at(self, t: float) -> float | None:
        s = self.samples
        if len(s) < 2 or t < s[0][0] or t > s[-1][0]:
            return None
        for (t0, b0), (t1, b1) in zip(s, s[1:], strict=False):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return None


# ------------------------------------------------------------------------------------ raw loopback round trip
def child_echo(p: dict[str, Any]) -> None:
    """A loopback echo server: prints its port, then echoes framed buffers until a 0-length frame."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(p.get("max_bytes", 64 << 20))
    view = memoryview(buf)
    while True:
        n = struct.unpack("!Q", _recv_exact(conn, memoryview(bytearray(8))))[0]
        if n == 0:
            break
        _recv_exact(conn, view[:n])
        conn.sendall(view[:n])
    conn.close()
    srv.close()


def _recv_exact(conn: socket.socket, view: memoryview) -> memoryview:
    got = 0
    while got < len(view):
        r = conn.recv_into(view[got:])
        if r == 0:
            raise ConnectionError("peer closed")
        got += r
    return view


def loopback_rates(sizes: list[int], min_seconds: float = 0.3, min_iters: int = 5) -> list[dict[str, Any]]:
    """Raw loopback TCP round trips against a subprocess echo server: 2 x size / median RTT."""
    max_bytes = max(sizes)
    proc = subprocess.Popen([sys.executable, str(ENTRY), "--child", "echo", "--params",
                             json.dumps({"max_bytes": max_bytes})], stdout=subprocess.PIPE, text=True)
    out = []
    try:
        port = int(proc.stdout.readline())
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(max_bytes)
        back = bytearray(max_bytes)
        for i in range(0, max_bytes, 4096):
            buf[i] = 1  # touch the pages
        for size in sizes:
            rtts: list[float] = []
            t_all = time.perf_counter()
            while len(rtts) < min_iters or time.perf_counter() - t_all < min_seconds:
                t0 = time.perf_counter()
                conn.sendall(struct.pack("!Q", size))
                conn.sendall(memoryview(buf)[:size])
                _recv_exact(conn, memoryview(back)[:size])
                rtts.append(time.perf_counter() - t0)
            rtt = statistics.median(rtts[1:]) if len(rtts) > 1 else rtts[0]
            out.append({"bytes": size, "rtt_ms": rtt * 1e3, "round_trips": len(rtts),
                        "gb_per_s": 2 * size / rtt / 1e9})
        conn.sendall(struct.pack("!Q", 0))
        conn.close()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out

