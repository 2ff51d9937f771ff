"""The suite's leak check (tests/helpers/leaks.py) on a run of tests that each leave one thing
behind: it must name each in that test's teardown, kill the processes and remove the files, and
pass the test that cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

LEAKY = '''
import os, socket, subprocess, tempfile, threading
from pathlib import Path

OUT = Path(os.environ["LEAK_OUT"])
_kept = []


def test_cleans_up():
    proc = subprocess.Popen(["sleep", "302"])
    proc.kill()
    proc.wait()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
    os.rmdir(tempfile.mkdtemp())


def test_leaks_a_daemon():
    # sh starts sleep in the background and exits: sleep is re-parented, no child of this process.
    subprocess.run(["sh", "-c", 'sleep 300 & echo $! > "$0"', str(OUT / "daemon")], check=True)


def test_leaks_a_child():
    _kept.append(subprocess.Popen(["sleep", "301"]))
    (OUT / "child").write_text(str(_kept[-1].pid))


def test_leaks_a_shared_memory_file():
    name = f"dtrain-{os.getpid():08x}{os.urandom(16).hex()}"
    Path("/dev/shm", name).write_bytes(b"x")
    (OUT / "shm").write_text(name)


def test_leaks_a_named_semaphore():  # (no process to blame: the run's end sees it)
    import _multiprocessing
    name = "mp-leaktest" + os.urandom(6).hex()
    _kept.append(_multiprocessing.SemLock(1, 1, 1, "/" + name, False))  # not unlinked, no tracker told
    (OUT / "semaphore").write_text("sem." + name)


def test_leaks_a_thread():
    threading.Thread(target=threading.Event().wait, name="dtrain-leaky", daemon=True).start()


def test_starts_the_page_thread():  # a scheduler's: only the session's end may see it
    threading.Thread(target=threading.Event().wait, name="dtrain-dashboard_0", daemon=True).start()


def test_leaks_a_temporary_directory():
    (OUT / "tmp").write_text(tempfile.mkdtemp(prefix="pymp-"))


def test_leaks_a_listening_socket():  # last: the session's own check sees it too (it stays open)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _kept.append(s)
    (OUT / "port").write_text(str(s.getsockname()[1]))
'''


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_leak_check_names_what_each_test_left_and_cleans_it_up(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    out = tmp_path / "out"
    out.mkdir()
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # a plain run, not a worker
    env = dict(outer, PYTHONPATH=str(ROOT), LEAK_OUT=str(out), DTRAIN_TEST_LEAK_GRACE_S="0.5")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.leaks", "-p", "no:cacheprovider",
                           "-rA", "test_leaky.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    report = proc.stdout
    assert proc.returncode == 1, report[-3000:]
    daemon, child = int((out / "daemon").read_text()), int((out / "child").read_text())
    port, shm, tmp = (out / "port").read_text(), (out / "shm").read_text(), (out / "tmp").read_text().strip()
    expected = {
        "test_leaks_a_daemon": f"process {daemon} (re-parented",
        "test_leaks_a_child": f"process {child} (a child of this process): sleep 301",
        "test_leaks_a_listening_socket": f"listening socket 127.0.0.1:{port}",
        "test_leaks_a_shared_memory_file": f"shared-memory file /dev/shm/{shm}",
        "test_leaks_a_temporary_directory": f"temporary directory {tmp}",
        "test_leaks_a_thread": "thread dtrain-leaky of the test process (still running)",
    }
    for test, line in expected.items():
        section = report.split(f"ERROR at teardown of {test} ", 1)[-1].split("\n___", 1)[0]
        assert f"test_leaky.py::{test} left behind:" in section and line in section, (test, report[-4000:])
    for test in ("test_cleans_up", "test_starts_the_page_thread"):
        assert f"PASSED test_leaky.py::{test}" in report and f"ERROR test_leaky.py::{test}" not in report, test
    assert "thread dtrain-dashboard_0 of the test process" in report.split("left behind by the session:", 1)[-1]
    # The session's own check sees the socket again (it stays open: nothing may close another's descriptor).
    assert "left behind by the session:" in report and report.count(f"listening socket 127.0.0.1:{port} ") >= 2
    assert "9 passed, 6 errors" in report, report[-1500:]
    semaphore = (out / "semaphore").read_text()
    assert "left behind by the run: 1 named semaphore(s)" in report and semaphore in report, report[-1500:]
    assert not Path("/dev/shm", semaphore).exists(), "the leaked semaphore was not removed"
    assert not alive(daemon) and not alive(child), "the leaked processes were not killed"
    assert not Path("/dev/shm", shm).exists() and not Path(tmp).exists()


def test_a_run_that_leaves_only_a_named_semaphore_fails(tmp_path):
    """Every test passes, yet the run fails: a semaphore names no test, so the run's end checks it.
    Fails if that check only prints (exit status 0) or does not run."""
    (tmp_path / "test_sem.py").write_text(
        LEAKY.split("def test_cleans_up", 1)[0] + "def test_leaks_a_named_semaphore" +
        LEAKY.split("def test_leaks_a_named_semaphore", 1)[1].split("\n\n\ndef ", 1)[0] + "\n")
    out = tmp_path / "out"
    out.mkdir()
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env = dict(outer, PYTHONPATH=str(ROOT), LEAK_OUT=str(out), DTRAIN_TEST_LEAK_GRACE_S="0.5")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.leaks", "-p", "no:cacheprovider",
                           "test_sem.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 passed" in proc.stdout and proc.returncode == 1, proc.stdout[-2000:]
    assert not Path("/dev/shm", (out / "semaphore").read_text()).exists()
