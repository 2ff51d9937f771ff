"""The suite's leak check, a pytest plugin (``tests/conftest.py`` loads it; ``-p tests.helpers.leaks``
loads it anywhere else). After every test, nothing that test started may outlive it:

- **processes**: every process the suite starts carries ``DTRAIN_TEST_ID=<session>:<test>`` in its
  environment (set here, inherited by every descendant however it was started, and by workers
  forked from a forkserver, which keep the marker of the test that started the server), so one
  re-parented to init after its parent was killed, or detached by a double fork, is still seen.
  Children forked from this process without an ``exec`` do not show the marker in
  ``/proc/<pid>/environ``; they are seen while they are its descendants.
- **listening TCP sockets** of this process (in-process clusters, ps and stage servers);
- **dtrain's threads** in this process (named ``dtrain-*``: a chief's lease renewer, a stream's
  reader, a ps's listener, a stage link's sender), which cannot be killed: reported only. The
  dashboard page's render thread lives as long as the scheduler that serves the page (the
  session's in-process one): the session's end checks it;
- **shared-memory files** ``/dev/shm/dtrain-<creator pid>...`` of this process or of a process of
  the suite;
- **temporary files and directories**, forkserver directories (``pymp-*``) and TLS directories
  included: the suite gets a private ``TMPDIR``, so whatever is new in it is the suite's;
- **named semaphores** (``/dev/shm/sem.mp-*``: multiprocessing's locks and queues under spawn or a
  forkserver, which a resource tracker unlinks once their processes are gone, unless it was killed
  with them): they name no process, so the whole run's end checks them, in the process that ran
  the session (xdist's controller), after every worker and its tracker is gone.

What a test leaves is reported in the test's teardown, which fails; leaked processes are then
SIGKILLed by pid, leaked files removed. Resources of broader fixtures (module, session) are set up
before a test's own check starts, so they never count against it; the session's end checks them.
Only this interpreter's multiprocessing helpers (its forkserver and resource tracker, and their
directory) are allowed to outlive the test that first needed them. The cost is two listings of
``/proc`` and of two directories per test, and a read of ``/proc/<pid>/environ`` only for
processes not seen before (about a millisecond).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MARKER = "DTRAIN_TEST_ID"
SHM = Path("/dev/shm")
# A process just killed, a server closing on its loop thread: gone within this (a setting, so the
# check's own test need not wait it out).
GRACE_S = float(os.environ.get("DTRAIN_TEST_LEAK_GRACE_S", "10"))
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# Made on first use and kept by design: torch's compile cache, and Dask's scratch directory (whose
# per-worker directories inside are checked: each goes with its worker; its lock files are Dask's
# bookkeeping, a killed worker's purged by the next worker to start).
CACHES = ("torchinductor_", "dask-scratch-space")
SCRATCH = "dask-scratch-space"
SCHEDULER_THREADS = ("dtrain-dashboard",)  # the /dtrain page's render thread: ends with the scheduler's plugin
_TOKEN = f"{os.getpid()}-{secrets.token_hex(4)}"
_NEEDLE = f"{MARKER}={_TOKEN}:".encode()
_ME = os.getpid()
_HZ = os.sysconf("SC_CLK_TCK")
_XDIST = "PYTEST_XDIST_WORKER" in os.environ  # one of several workers of one suite (make test runs two)


@dataclass
class _Proc:
    ppid: int
    start: int  # clock ticks after boot: tells a reused pid from the process it was
    ours: bool  # carries this session's marker, or descends from this process


@dataclass
class _Snapshot:
    pids: set[int]
    ticks: int  # clock ticks after boot when it was taken
    sockets: set[str]
    shm: set[str]
    tmp: set[str]
    threads: set[int]


@dataclass
class _State:
    tmpdir: Path | None = None
    procs: dict[int, _Proc] = field(default_factory=dict)  # every live pid seen, classified once
    gone: dict[int, bool] = field(default_factory=dict)  # pid -> ours, of processes that ended since


_state = _State()


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc/<pid>/stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _marked(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return _NEEDLE in f.read()
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _pids() -> set[int]:
    """Every live pid, each new one classified (ours or not) as it is first seen."""
    pids = {int(n) for n in os.listdir("/proc") if n.isdigit()}
    procs = _state.procs
    for pid in procs.keys() - pids:
        _state.gone[pid] = procs.pop(pid).ours
    if len(_state.gone) > 8192:
        for pid in list(_state.gone)[:4096]:
            del _state.gone[pid]
    # Parents first (a lower pid, unless pids wrapped), so a child of a new process of ours is ours.
    for pid in sorted(pids - procs.keys()):
        st = _stat(pid)
        if st is None:
            continue
        parent = procs.get(st[1])
        procs[pid] = _Proc(st[1], st[2], st[1] == _ME or (parent is not None and parent.ours) or _marked(pid))
    return pids


def _sockets() -> set[str]:
    """This process's socket descriptors, as 'fd:socket:[inode]'."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(f"{fd}:{link}")
    return out


def _listening(entry: str) -> str | None:
    """'host:port' when the descriptor is a listening TCP socket (still the same socket), else None."""
    fd, inode = entry.split(":", 1)
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != inode:
            return None
        dup = socket.socket(fileno=os.dup(int(fd)))
    except OSError:
        return None
    try:
        if dup.family not in (socket.AF_INET, socket.AF_INET6) or dup.type != socket.SOCK_STREAM:
            return None
        if not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        host, port = dup.getsockname()[:2]
        return f"{host}:{port}"
    except OSError:
        return None
    finally:
        dup.close()


def _shm() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith("dtrain-")}
    except OSError:
        return set()


def _own_mp_dir() -> str | None:
    """This interpreter's multiprocessing directory (its forkserver's socket): lives as long as it."""
    import multiprocessing.process

    path = multiprocessing.process.current_process()._config.get("tempdir")
    return os.path.basename(path) if path else None


def _tmp() -> set[str]:
    if _state.tmpdir is None:
        return set()
    try:
        names = {n for n in os.listdir(_state.tmpdir) if not n.startswith(CACHES)} - {_own_mp_dir()}
    except OSError:
        return set()
    try:
        names |= {f"{SCRATCH}/{n}" for n in os.listdir(_state.tmpdir / SCRATCH) if not n.endswith((".lock", ".dirlock"))}
    except OSError:
        pass
    return names


def _ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * _HZ)


def snapshot() -> _Snapshot:
    return _Snapshot(_pids(), _ticks(), _sockets(), _shm(), _tmp(), {t.ident for t in _threads()})


def _threads(session: bool = True) -> list[threading.Thread]:
    """dtrain's own threads in this process (named ``dtrain-*``: a lease renewer, a stream's
    reader, a ps's listener, a stage link's sender): each ends with what started it. Not
    ``session``: the threads of a scheduler's page (``SCHEDULER_THREADS``) are left out."""
    return [t for t in threading.enumerate() if t.name.startswith("dtrain-") and t.ident is not None
            and (session or not t.name.startswith(SCHEDULER_THREADS))]


def _helper(pid: int) -> bool:
    """This interpreter's forkserver or resource tracker (they end when it does), not a fork of one."""
    proc = _state.procs.get(pid)
    return proc is not None and proc.ppid == _ME and any(h in _cmdline(pid) for h in HELPERS)


def _alive(pid: int, proc: _Proc) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == proc.start and st[0] not in ("Z", "X")


def _shm_ours(name: str) -> bool:
    """A shm file is ours when its creator (the pid its name leads with) is this process, a process
    of the suite, or one that lived and ended within the test unseen (it cannot be told from another
    run's then: on a machine shared with another dtrain suite this may, rarely, be theirs). Under
    pytest-xdist the other workers are such runs, and busy ones: there an unseen creator is not ours."""
    try:
        pid = int(name[len("dtrain-"):len("dtrain-") + 8], 16)
    except ValueError:
        return False
    if pid == _ME:
        return True
    if pid in _state.procs:
        return _state.procs[pid].ours
    return _state.gone.get(pid, not _XDIST)


def _find(before: _Snapshot, session: bool) -> tuple[dict[int, _Proc], set[str], set[str], set[str], set[str]]:
    after = snapshot()
    # New: a pid not there before, or one reused since (it started after the snapshot).
    procs = {pid: p for pid, p in _state.procs.items()
             if p.ours and (pid not in before.pids or p.start > before.ticks) and not _helper(pid) and _alive(pid, p)}
    sockets = {s for s in after.sockets - before.sockets if _listening(s)}
    shm = {n for n in after.shm - before.shm if _shm_ours(n)}
    threads = {t.name for t in _threads(session) if t.ident not in before.threads}
    return procs, sockets, shm, after.tmp - before.tmp, threads


def check(before: _Snapshot, grace_s: float = GRACE_S, session: bool = False) -> list[str]:
    """What the code run since ``before`` left behind (a process, a listening socket, a /dev/shm
    file, a temporary file), one line each after waiting ``grace_s`` for it to go; leaked processes
    are SIGKILLed and leaked files removed."""
    deadline = time.monotonic() + grace_s
    while True:
        procs, sockets, shm, tmp, threads = _find(before, session)
        if not (procs or sockets or shm or tmp or threads) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    lines = []
    for pid, proc in sorted(procs.items()):
        parent = _state.procs.get(proc.ppid)
        where = ("a child of this process" if proc.ppid == _ME else
                 f"a child of {proc.ppid}, of this run" if parent is not None and parent.ours else
                 "re-parented to init" if proc.ppid == 1 else f"re-parented to {proc.ppid}")
        lines.append(f"process {pid} ({where}): {_cmdline(pid)[:200]}  [SIGKILLed]")
        if _alive(pid, proc):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for entry in sorted(sockets):
        address = _listening(entry)
        lines.append(f"listening socket {address} (fd {entry.split(':', 1)[0]}) of the test process")
    for name in sorted(threads):
        lines.append(f"thread {name} of the test process (still running)")
    for name in sorted(shm):
        lines.append(f"shared-memory file {SHM / name}  [removed]")
        (SHM / name).unlink(missing_ok=True)
    for name in sorted(tmp):
        path = _state.tmpdir / name
        lines.append(f"temporary {'directory' if path.is_dir() else 'file'} {path}  [removed]")
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return lines


def pytest_configure(config: pytest.Config) -> None:
    """Mark the session (module-level copies of the environment, made at collection, carry it too)
    and give it a private TMPDIR; pytest's own temporary directories stay where they were."""
    os.environ[MARKER] = f"{_TOKEN}:collect"
    if _state.tmpdir is None:
        root = tempfile.gettempdir()
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
        _state.tmpdir = Path(tempfile.mkdtemp(prefix="dtrain-tests-", dir=root))
        os.environ["TMPDIR"] = str(_state.tmpdir)
        tempfile.tempdir = str(_state.tmpdir)
    snapshot()


SEMAPHORES = "sem.mp-"  # multiprocessing's named semaphores in /dev/shm
_semaphores_before: set[str] | None = None  # at the start of the run (the controller's, or a plain run's)


def _semaphores() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(SEMAPHORES)}
    except OSError:
        return set()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _semaphores_before
    if not _XDIST:
        _semaphores_before = _semaphores()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run's named semaphores that outlive it (module docstring) fail it, and are removed. The
    trackers of processes that just ended unlink theirs within ``GRACE_S``."""
    if _XDIST or _semaphores_before is None:
        return
    deadline = time.monotonic() + GRACE_S
    while (left := _semaphores() - _semaphores_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    for name in left:
        try:
            (SHM / name).unlink()
        except OSError:
            pass
    shown = ", ".join(sorted(left)[:4]) + (", ..." if len(left) > 4 else "")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"left behind by the run: {len(left)} named semaphore(s) in {SHM} ({shown}; removed): "
                            "a process group killed together with its multiprocessing resource tracker? "
                            "(tests/helpers/runs.py: crash_group)", red=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """The private TMPDIR goes after multiprocessing has removed its own directory in it (at exit)."""
    if _state.tmpdir is not None:
        from multiprocessing import util

        util.Finalize(None, shutil.rmtree, args=(str(_state.tmpdir),), kwargs={"ignore_errors": True},
                      exitpriority=-200)


@pytest.fixture(autouse=True)
def _nothing_outlives_the_test(request: pytest.FixtureRequest):
    """The per-test check (module docstring). Broader fixtures are set up before this one starts."""
    os.environ[MARKER] = f"{_TOKEN}:{request.node.nodeid}"[:2000]
    before = snapshot()
    yield
    leaks = check(before)
    if leaks:
        pytest.fail(f"{request.node.nodeid} left behind:\n  " + "\n  ".join(leaks), pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _nothing_outlives_the_session():
    """No process of the session (a worker, a scheduler, a nanny, a daemon), shared-memory file or
    temporary file outlives it; fixtures of module and session scope included."""
    start = snapshot()
    yield
    leaks = check(start, session=True)
    assert not leaks, "left behind by the session:\n  " + "\n  ".join(leaks)
    assert threading.active_count() < 200
