"""The lab's network: N hosts on this machine, each a set of Linux namespaces with its own
full-duplex link to one bridge.

A host is one holder process made by ``unshare --net --pid --mount --uts --fork --mount-proc``:
its own network stack (an ``eth0`` with an address in 198.18.0.0/15, the benchmarking range of
RFC 2544), its own PID namespace and /proc (no process of another host is visible), and its own
mount namespace with a private tmpfs on /dev/shm and its own /sys. Network namespaces alone would
share /dev/shm and /proc, and dtrain's data plane would then map a replica's shared-memory slots
from a ps on another "host" (dtrain/dataplane/shm.py opens the file by name, and the parameters
through /proc/<pid>/fd): with its own /dev/shm and /proc a host is as far from the others as a
separate machine is, and every byte between tasks crosses the links.

Links: a veth pair per host, ``eth0`` inside, ``<lab>h<i>`` outside on the bridge. A token
bucket (``tbf``) shapes egress at both ends: inside, what the host sends; outside, what it
receives. Each direction has its own bucket, so a host can send and receive at the link's rate at
once (full duplex), and two hosts' traffic never shares a bucket, as on a switch. A degraded link
is a lower rate (:meth:`Lab.set_rate`) and a partition is the link taken down
(:meth:`Lab.partition`). The kernel's ``netem`` (delay, loss) is not used: this project's
development machine's kernel lacks it (:func:`has_netem` says whether this one has it).

Teardown (:meth:`Lab.close`, also on ``with``-exit, at interpreter exit and on SIGTERM/SIGINT):
the holders are killed; a PID namespace's init dying kills every process in it, the network
namespace goes with its last process and takes its veth pair with it; then the bridge is deleted.
Each holder's ``unshare`` runs with ``PR_SET_PDEATHSIG`` and ``--kill-child``: if the controlling
process is killed outright (SIGKILL, where no handler runs), the hosts die with it, and only the
bridge is left, which the next lab sweeps (its name carries the dead owner's pid).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SUBNET = "198.18.0.0/15"  # RFC 2544's benchmarking range: never routed, never someone's service
PREFIX_LEN = 15
FIRST_HOST = (198, 18, 0, 10)  # host i is 198.18.0.(10 + i)
PREFIX = "dtl"  # every interface the lab makes starts with it (the sweep touches nothing else)
_PR_SET_PDEATHSIG = 1
_numbers = itertools.count()
# tbf's bucket: at least one 64 KiB GSO packet (veth offloads segment late), and at 10 Gbit/s
# enough for the timer's granularity; the latency bounds the queue (ties up no more than that).
LATENCY = "20ms"


def burst_for(rate_bits: float) -> str:
    """tbf's burst for a rate: ~1 ms of traffic, at least 128 KiB (one GSO packet and more)."""
    return f"{max(128 * 1024, int(rate_bits / 8 / 1000))}b"


class LabUnavailable(RuntimeError):
    """The lab cannot be built here (not root, no namespaces, no ip/tc): the message says why."""


def _run(cmd: Sequence[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pdeathsig() -> None:  # preexec: die with the controlling process (see the module docstring)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def probe() -> str | None:
    """None when the lab can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the lab needs root (network, PID and mount namespaces, veth, bridges, tc)"
    missing = [t for t in ("unshare", "nsenter", "ip", "tc", "mount") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH"
    name = f"{PREFIX}p{os.getpid():x}"[:15]
    try:
        proc = _run(["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "--mount-proc", "sh", "-c",
                     "mount -t tmpfs tmpfs /dev/shm && ip link set lo up"], check=False)
        if proc.returncode != 0:
            return f"cannot create network, PID and mount namespaces: {proc.stderr.strip() or proc.returncode}"
        proc = _run(["ip", "link", "add", name, "type", "bridge"], check=False)
        if proc.returncode != 0:
            return f"cannot create a bridge: {proc.stderr.strip()}"
        proc = _run(["tc", "qdisc", "add", "dev", name, "root", "tbf", "rate", "1gbit", "burst", "128kb",
                     "latency", LATENCY], check=False)
        if proc.returncode != 0:
            return f"tc's tbf qdisc is not available: {proc.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _run(["ip", "link", "del", name], check=False)
    return None


def has_netem() -> bool:
    """Whether this kernel has netem (delay, loss): tried on the loopback of a throwaway namespace."""
    proc = _run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                check=False)
    return proc.returncode == 0


def lab_interfaces() -> list[str]:
    """Every interface of the root namespace the lab made (its bridges and host-side veths)."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [m.group(1) for m in re.finditer(r"^\d+:\s+([^:@\s]+)", out, re.M)]
    return [n for n in names if n.startswith(PREFIX)]


def sweep_stale() -> list[str]:
    """Delete the interfaces of labs whose owner (the pid in their names) is gone: the bridge and
    any host-side veth still there (a namespace is freed asynchronously after its last process).
    Returns their names."""
    swept = []
    for name in lab_interfaces():
        m = re.fullmatch(rf"{PREFIX}([0-9a-f]+)x[0-9a-f]+(s|h\d+)", name)
        if m and not os.path.exists(f"/proc/{int(m.group(1), 16)}"):
            _run(["ip", "link", "del", name], check=False)
            swept.append(name)
    return swept


@dataclass
class Host:
    """One lab host: its name, address, and the holder (PID 1 of its namespaces)."""

    name: str
    index: int
    address: str
    veth: str  # the outer end of its veth pair, on the bridge (eth0 is the inner one)
    holder: subprocess.Popen  # unshare
    init_pid: int  # unshare's child: PID 1 inside, the namespaces' owner
    procs: list[subprocess.Popen] = field(default_factory=list)

    def nsenter(self) -> list[str]:
        return ["nsenter", "-t", str(self.init_pid), "--net", "--pid", "--mount", "--uts"]

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` as it runs on this host (in all its namespaces, in ``cwd``)."""
        return [*self.nsenter(), f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 60, **kw: Any
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion (output captured)."""
        proc = subprocess.run(self.command(argv, kw.pop("cwd", None)), capture_output=True, text=True,
                              timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.name}: `{' '.join(argv)}` failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}")
        return proc

    def popen(self, argv: Sequence[str], cwd: str | None = None, **kw: Any) -> subprocess.Popen:
        """Start ``argv`` on this host, in a new session: :meth:`stop` signals its whole group
        (nsenter and what it forked). Every process still runs in the host's PID namespace, so
        the host's teardown ends it in any case."""
        proc = subprocess.Popen(self.command(argv, cwd), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the process group, SIGKILL to what of it still runs after ``grace_s``; the
        exit code (None if unknown). The group's leader is ``nsenter``, which dies of the SIGTERM at
        once: the command it runs (a Dask nanny and its worker, which remove their scratch
        directories as they close) is waited for until no process of the group runs."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None and not _group_running(proc.pid):
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (proc.poll() is None or _group_running(proc.pid)):
                time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the group's leader left behind
        return proc.poll()

    def pids(self) -> list[int]:
        """Every process in this host's PID namespace, as pids of the root namespace."""
        try:
            ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{d}/ns/pid") == ns:
                        out.append(int(d))
        return out

    def listening(self) -> set[int]:
        """The TCP ports something listens on in this host (its own network namespace)."""
        out = self.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout.splitlines()
        ports = set()
        for line in out:
            f = line.split()
            if len(f) > 3 and f[3] == "0A" and ":" in f[1]:  # state 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
        return ports

    def counters(self) -> dict[str, int]:
        """eth0's byte counters, as this host sees them (tx: sent by it; rx: received)."""
        out = self.run(["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                        "/sys/class/net/eth0/statistics/rx_bytes"]).stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}


class Lab:
    """N hosts on one bridge, each with a full-duplex link of ``rate`` (tc syntax: ``10gbit``).

    ``with Lab(["scheduler", "ps0", "worker0"], rate="1gbit") as lab: lab["ps0"].popen([...])``.
    See the module docstring for what a host is and how everything is torn down."""

    def __init__(self, names: Sequence[str], rate: str | None = "10gbit", shm_size: str = "512m"):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and at least one: {list(names)}")
        self.names = list(names)
        self.rate = rate
        self.shm_size = shm_size
        # Interface names (15 characters at most): dtl<owner pid>x<lab number>s for the bridge
        # (the switch), ...h<i> for host i's veth; 's' and 'h' are no hex digits, so a sweep
        # reads the owner's pid back unambiguously.
        self.id = f"{os.getpid():x}x{next(_numbers) % 256:02x}"
        self.bridge = f"{PREFIX}{self.id}s"
        if len(self.bridge) > 15 or len(f"{PREFIX}{self.id}h{len(names) - 1}") > 15:
            raise ValueError(f"interface names too long for pid {os.getpid()}")
        self.hosts: dict[str, Host] = {}
        self._closed = False
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ building
    def __enter__(self) -> Lab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def open(self) -> Lab:
        why = probe()
        if why:
            raise LabUnavailable(why)
        sweep_stale()
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: atexit and __exit__ still hold
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i, name in enumerate(self.names):
                self.hosts[name] = self._add_host(name, i)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, name: str, i: int) -> Host:
        address = ".".join(map(str, (*FIRST_HOST[:3], FIRST_HOST[3] + i)))
        hostname = re.sub(r"[^a-z0-9-]", "-", name.lower())[:63]
        setup = (f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
                 f"mount -t sysfs sysfs /sys && hostname {hostname} && echo ready && exec sleep infinity")
        holder = subprocess.Popen(["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "--mount-proc",
                                   "--propagation", "private", "--kill-child=SIGKILL", "sh", "-c", setup],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=_pdeathsig, start_new_session=True)
        line = holder.stdout.readline() if holder.stdout else ""
        if line.strip() != "ready":
            holder.kill()
            raise RuntimeError(f"host {name}: namespaces not made: {holder.stderr.read() if holder.stderr else ''}")
        children = open(f"/proc/{holder.pid}/task/{holder.pid}/children").read().split()
        host = Host(name, i, address, f"{PREFIX}{self.id}h{i}", holder, int(children[0]))
        self.hosts[name] = host  # torn down with the others from here on
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", str(host.init_pid)])
        _run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        ns = ["nsenter", "-t", str(host.init_pid), "--net"]
        _run([*ns, "ip", "link", "set", "lo", "up"])
        _run([*ns, "ip", "addr", "add", f"{address}/{PREFIX_LEN}", "dev", "eth0"])
        _run([*ns, "ip", "link", "set", "eth0", "up"])
        if self.rate:
            self._shape(host, self.rate)
        return host

    # ------------------------------------------------------------------ links
    def _shape(self, host: Host, rate: str) -> None:
        bits = _rate_bits(rate)
        args = ["tbf", "rate", rate, "burst", burst_for(bits), "latency", LATENCY]
        _run(["tc", "qdisc", "replace", "dev", host.veth, "root", *args])  # into the host
        _run(["nsenter", "-t", str(host.init_pid), "--net", "tc", "qdisc", "replace", "dev", "eth0", "root", *args])

    def set_rate(self, name: str, rate: str) -> None:
        """Both directions of ``name``'s link shaped to ``rate`` (a degraded link: ``10mbit``)."""
        self._shape(self.hosts[name], rate)

    def partition(self, name: str) -> None:
        """Cut ``name`` off the network: its link down at the bridge (both directions). Its
        processes keep running and keep their sockets, as a host behind a failed switch port does."""
        _run(["ip", "link", "set", self.hosts[name].veth, "down"])

    def heal(self, name: str) -> None:
        """Undo :meth:`partition`."""
        _run(["ip", "link", "set", self.hosts[name].veth, "up"])

    def qdiscs(self, name: str) -> dict[str, str]:
        """``tc qdisc show`` at both ends of ``name``'s link (outside: into the host; inside: out of it)."""
        host = self.hosts[name]
        return {"into": _run(["tc", "qdisc", "show", "dev", host.veth]).stdout.strip(),
                "out_of": host.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout.strip()}

    # ------------------------------------------------------------------ teardown
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.close()
        old = self._old_handlers.get(signum)
        signal.signal(signum, old if old is not None else signal.SIG_DFL)
        if callable(old):
            old(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Kill every host (and so every process in it), wait until their namespaces are gone,
        delete the bridge. Idempotent; safe from a signal handler and at exit."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for proc in host.procs:  # politely first: the run's processes flush their logs
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for host in self.hosts.values():
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        for host in self.hosts.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.init_pid, signal.SIGKILL)  # PID 1 of the host: the kernel kills the rest
        for host in self.hosts.values():
            # unshare reaps its child and exits once every process of the PID namespace is gone
            # (killing unshare first would leave the child a zombie of whoever adopts it).
            try:
                host.holder.wait(10)
            except subprocess.TimeoutExpired:
                host.holder.kill()
                host.holder.wait(5)
            for proc in host.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        deadline = time.monotonic() + 10.0
        veths = {h.veth for h in self.hosts.values()}
        while veths & set(lab_interfaces()) and time.monotonic() < deadline:
            time.sleep(0.05)  # a netns is freed asynchronously after its last process
        for name in veths & set(lab_interfaces()):
            _run(["ip", "link", "del", name], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, old)

    def leftovers(self) -> list[str]:
        """What of this lab still exists (interfaces, live processes): empty after :meth:`close`."""
        left = [n for n in lab_interfaces() if n.startswith(f"{PREFIX}{self.id}")]
        for host in self.hosts.values():
            if os.path.exists(f"/proc/{host.init_pid}") and _alive(host.init_pid):
                left.append(f"{host.name}: init pid {host.init_pid}")
            left += [f"{host.name}: pid {p.pid}" for p in host.procs if _alive(p.pid)]
        return left


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie does not: the orphans of a host
    are reaped by nobody, its PID 1 being ``sleep``)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
                return True
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"rate {rate!r}: a number and one of {', '.join(_UNITS)}, e.g. 10gbit, 1gbit, 100mbit")
    return float(m.group(1)) * _UNITS[m.group(2)]
