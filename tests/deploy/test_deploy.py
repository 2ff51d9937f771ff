"""Deployment on a real Dask cluster made of separate OS processes, as users run it (issue 6):
`dask scheduler`, one `dtrain worker` per task, `dtrain run --scheduler`; the same with TLS
(and plain connections refused); a missing ps task; and examples/deploy_local.sh.

Every process is started here, stopped here by pid (SIGTERM, then SIGKILL after a grace period),
and checked to be gone. One scheduler + 4 workers are shared by the tests of each cluster kind
(module-scoped fixtures) to keep process launches few on a 2-core machine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import psutil
import pytest
import yaml
from distributed import Client

from dtrain.deploy.cluster import HOUSEKEEPING
from tests.helpers.observe import fetch
from tests.helpers.orphans import alive
from tests.helpers.paths import ROOT

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT), DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL="30s")
TASKS = [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
GRACE_S = 30

pytestmark = pytest.mark.processes


class ProcessCluster:
    """A `dask scheduler` and `dtrain worker` processes on 127.0.0.1, logs in ``workdir``."""

    def __init__(self, workdir: Path, certs: Path | None = None):
        self.workdir = workdir
        self.certs = certs
        self.scheduler: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.address = ""
        self._family: dict[int, dict[int, float]] = {}  # started pid -> {pid: create_time} of it and its children

    # -- starting
    def tls_flags(self) -> list[str]:
        if self.certs is None:
            return []
        return ["--tls-ca-file", str(self.certs / "ca.pem"), "--tls-cert", str(self.certs / "cluster.pem"),
                "--tls-key", str(self.certs / "cluster-key.pem")]

    def security(self):
        if self.certs is None:
            return None
        from distributed.security import Security

        return Security(tls_ca_file=str(self.certs / "ca.pem"), tls_client_cert=str(self.certs / "cluster.pem"),
                        tls_client_key=str(self.certs / "cluster-key.pem"), require_encryption=True)

    def _popen(self, cmd: list[str], log: str) -> subprocess.Popen:
        with open(self.workdir / log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        self._remember(proc.pid)
        return proc

    def _remember(self, pid: int) -> None:
        family = self._family.setdefault(pid, {})
        try:
            p = psutil.Process(pid)
            family[pid] = p.create_time()
            family.update({c.pid: c.create_time() for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass

    @property
    def pids(self) -> dict[int, float]:
        """Every process started here, their children included."""
        return {pid: t for family in self._family.values() for pid, t in family.items()}

    def log_tail(self, log: str, n: int = 3000) -> str:
        path = self.workdir / log
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def start_scheduler(self) -> str:
        sched_file = self.workdir / "scheduler.json"
        self.scheduler = self._popen([PY, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                                      "--scheduler-file", str(sched_file), "--no-dashboard",
                                      # (its HTTP server still serves /metrics: on 127.0.0.1 only)
                                      "--dashboard-address", "127.0.0.1:0", *self.tls_flags()],
                                     "scheduler.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.scheduler.poll() is None, self.log_tail("scheduler.log")
            try:
                self.address = json.loads(sched_file.read_text())["address"]
                break
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        else:
            raise AssertionError("no scheduler file after 60 s\n" + self.log_tail("scheduler.log"))
        assert self.address.startswith("tls://" if self.certs else "tcp://127.0.0.1:"), self.address
        return self.address

    def start_worker(self, job: str, task: int) -> None:
        name = f"{job}-{task}"
        self.workers[name] = self._popen(
            [PY, "-m", "dtrain.cli", "worker", "--job", job, "--task", str(task), "--scheduler", self.address,
             "--host", "127.0.0.1", "--nthreads", "2", "--memory-limit", "2GiB", *self.tls_flags()],
            f"{name}.log")

    def worker_names(self) -> set[str]:
        from distributed import Client

        with Client(self.address, security=self.security(), timeout=30, set_as_default=False) as c:
            return {str(w["name"]) for w in c.scheduler_info(n_workers=-1)["workers"].values()}

    def wait_for(self, names: set[str], timeout: float = 180) -> None:
        from distributed import Client

        deadline = time.monotonic() + timeout
        with Client(self.address, security=self.security(), timeout=30, set_as_default=False) as c:
            while True:
                for name, proc in self.workers.items():
                    assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log_tail(name + '.log')}"
                info = c.scheduler_info(n_workers=-1)["workers"]
                have = {str(w["name"]): w for w in info.values()}
                if names <= set(have):
                    break
                assert time.monotonic() < deadline, f"workers {sorted(names - set(have))} did not join"
                time.sleep(0.2)
        for name in names:
            assert have[name]["resources"].get(name.rsplit("-", 1)[0]) == 1
        for proc in self.workers.values():
            self._remember(proc.pid)  # the nannies' worker processes exist now

    # -- stopping
    def _stop(self, procs: list[subprocess.Popen]) -> None:
        """SIGTERM each process, wait for it and its children, SIGKILL what is left after GRACE_S."""
        for p in procs:
            self._remember(p.pid)
        family = {pid: t for p in procs for pid, t in self._family[p.pid].items()}
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline and alive(family):
            time.sleep(0.1)
        for pid in alive(family):
            os.kill(pid, signal.SIGKILL)
        for p in procs:
            if p.poll() is None:
                p.wait(timeout=10)

    def stop_worker(self, name: str) -> None:
        self._stop([self.workers[name]])

    def shutdown(self) -> list[int]:
        """Stop the workers, then the scheduler; return the pids of started processes still alive."""
        self._stop([p for p in self.workers.values() if p.poll() is None])
        if self.scheduler is not None:
            self._stop([self.scheduler])
        return alive(self.pids)


def dtrain(*args: str, timeout: float = 480) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([PY, "-m", "dtrain.cli", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


def start_cluster(workdir: Path, certs: Path | None = None, tasks=TASKS) -> ProcessCluster:
    cluster = ProcessCluster(workdir, certs)
    try:
        cluster.start_scheduler()
        for job, task in tasks:
            cluster.start_worker(job, task)
        cluster.wait_for({f"{j}-{t}" for j, t in tasks})
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def assert_trained(run_dir: Path, cluster: ProcessCluster, out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["global_step"] >= 1500
    assert summary["eval"]["accuracy"] >= 0.95, summary
    # every task ran in one of the worker processes started here, none in an embedded cluster
    tasks = json.loads((run_dir / "cluster.json").read_text())["tasks"]
    assert set(tasks) == {f"/job:{j}/task:{t}" for j, t in TASKS}
    started = set(cluster.pids)
    assert all(int(t["pid"]) in started for t in tasks.values()), (tasks, started)
    return summary


# --------------------------------------------------------------------------------- plain tcp://


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("plain-cluster"))
    yield cluster
    cluster.shutdown()


@pytest.mark.timeout(600)
def test_digits_async_on_scheduler_and_four_dtrain_worker_processes(plain, tmp_path):
    run_dir = tmp_path / "run"
    out, _ = dtrain("run", "pipelines/digits_async.yaml", "--scheduler", plain.address, "--run-dir", str(run_dir),
                    "--quiet")
    assert_trained(run_dir, plain, out)
    assert "completed at step" in out.stdout
    assert plain.worker_names() == {"ps-0", "ps-1", "worker-0", "worker-1"}  # the workers outlive the run
    # The deployed scheduler took dtrain's plugin: its Prometheus endpoint serves the run's series
    # (the last report, its totals), per replica and per shard.
    with Client(plain.address, timeout=30) as c:
        metrics = fetch(c.dashboard_link.replace("/status", "/metrics"))[1]
        # `dtrain worker` runs Dask's housekeeping at dtrain's pace (the event-loop tick at 500 ms,
        # not Dask's 20 ms...: docs/performance.md, "Dask's own housekeeping")
        settings = c.run(lambda: {key: dask.config.get(key) for key in HOUSEKEEPING})
    assert list(settings.values()) == [HOUSEKEEPING] * 4, settings
    for i in range(2):
        assert f'replica="{i}"' in metrics and 'name="digits-async"' in metrics
        assert re.search(r'run="digits-async-[0-9a-f]{8}"', metrics)  # the run's id: its name and a token
        assert re.search(rf'dtrain_shard_applies_total\{{[^}}]*shard="{i}"[^}}]*\}} [1-9]', metrics), metrics[-3000:]
    assert re.search(r'dtrain_replica_steps_total\{[^}]*\} [1-9]', metrics)


def _training_threads() -> tuple[list[str], int]:
    """(the data plane's dtrain-ps* threads, the threads running replica code) in this worker."""
    import sys
    import threading

    names = [t.name for t in threading.enumerate() if t.name.startswith("dtrain-ps")]
    busy = 0
    for frame in sys._current_frames().values():
        while frame is not None and "/dtrain/worker/" not in frame.f_code.co_filename:
            frame = frame.f_back
        busy += frame is not None
    return names, busy


LEASE_S = 18


@pytest.mark.timeout(600)
def test_a_killed_chief_leaves_no_training_on_the_workers(plain, tmp_path):
    """SIGKILL `dtrain run` mid-training. The workers outlive it. Within 15 s its replicas stop
    (their tasks' client left the scheduler), while the ps shards keep their lease rule: they stop
    and close their data plane only when the lease (cluster.lease_s) runs out; then no dtrain-ps*
    thread and no replica code is left running in any worker."""
    from distributed import Client

    with open(tmp_path / "chief.log", "wb") as log:
        chief = subprocess.Popen([PY, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml", "--scheduler",
                                  plain.address, "--run-dir", str(tmp_path / "run"), "--quiet",
                                  "--set", "training.steps=10000000", "--set", f"cluster.lease_s={LEASE_S}"],
                                 cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        with Client(plain.address, timeout=30, set_as_default=False) as c:
            deadline = time.monotonic() + 180
            while True:  # training: both ps listening, both replicas in their loop
                seen = c.run(_training_threads)
                ps = [n for w in seen.values() for n in w[0] if n.endswith("-accept")]
                if len(ps) == 2 and sum(w[1] for w in seen.values()) >= 2:
                    break
                assert chief.poll() is None, (tmp_path / "chief.log").read_text()[-3000:]
                assert time.monotonic() < deadline, seen
                time.sleep(0.5)
            time.sleep(1)
            os.kill(chief.pid, signal.SIGKILL)
            chief.wait(30)
            killed = time.monotonic()
            while True:
                seen = c.run(_training_threads)
                if not any(busy for _, busy in seen.values()):
                    break
                assert time.monotonic() - killed < 15, f"replicas still training 15 s after the chief was killed: {seen}"
                time.sleep(0.5)
            # the shards' lease has not run out: their data planes still listen
            assert sum(n.endswith("-accept") for names, _ in seen.values() for n in names) == 2, seen
            assert time.monotonic() - killed < LEASE_S - 5, "too slow to tell the replicas' stop from the lease's"
            while True:
                seen = c.run(_training_threads)
                if not any(names for names, _ in seen.values()):
                    break
                assert time.monotonic() - killed < LEASE_S + 30, f"data plane still open " \
                                                                 f"{time.monotonic() - killed:.0f} s after the kill: {seen}"
                time.sleep(1)
    finally:
        if chief.poll() is None:
            os.kill(chief.pid, signal.SIGKILL)
            chief.wait(30)
    assert plain.worker_names() == {"ps-0", "ps-1", "worker-0", "worker-1"}


@pytest.mark.timeout(600)
def test_missing_ps_task_exits_1_naming_it_after_wait_s(plain, tmp_path):
    plain.stop_worker("ps-1")
    deadline = time.monotonic() + 60
    while "ps-1" in plain.worker_names():
        assert time.monotonic() < deadline, "ps-1 still registered"
        time.sleep(0.2)
    # --scheduler may also be the file `dask scheduler --scheduler-file` wrote
    out, elapsed = dtrain("run", "pipelines/digits_async.yaml", "--scheduler", str(plain.workdir / "scheduler.json"),
                          "--run-dir", str(tmp_path / "run"), "--quiet", "--set", "cluster.wait_s=5", timeout=180)
    assert out.returncode == 1, out.stderr[-3000:]
    err = out.stderr
    assert "/job:ps/task:1" in err and "after waiting 5 s" in err, err[-3000:]
    assert "/job:ps/task:0" not in err.split("workers present")[0]  # only the missing task is named
    assert f"dtrain worker --job ps --task 1 --scheduler {plain.address}" in err
    assert "Traceback" not in err
    assert elapsed < 5 + 90  # the wait plus the start of a Python process on a busy machine


def test_every_server_of_a_dtrain_worker_binds_its_host(plain):
    """`dtrain worker --host 127.0.0.1`: no socket of its processes (the nanny, the worker, the
    worker's HTTP server for /metrics and /health) listens on every interface."""
    plain.start_worker("probe", 0)
    probe = plain.workers.pop("probe-0")  # (not one of the cluster's tasks: stopped here)
    try:
        deadline = time.monotonic() + 180
        while "probe-0" not in plain.worker_names():
            assert probe.poll() is None, plain.log_tail("probe-0.log")
            assert time.monotonic() < deadline, "probe-0 did not join"
            time.sleep(0.2)
        plain._remember(probe.pid)  # its nanny's worker process exists now
        tree = plain._family[probe.pid]
        listening = [(pid, c.laddr) for pid in tree for c in psutil.Process(pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
    finally:
        plain._stop([probe])
    assert len(listening) >= 3, listening  # the nanny, the worker, its HTTP server
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening


@pytest.mark.timeout(600)
def test_a_stopped_scheduler_fails_the_run_with_a_summary(plain, tmp_path):
    """SIGSTOP the `dask scheduler` under a training run: the chief's next question to it gets no
    answer within cluster.scheduler_timeout_s (5 s here; 30 s by default), and the run fails (exit 1)
    with one line naming the scheduler and the setting, its summary written; nothing hangs."""
    run_dir = tmp_path / "run"
    chief = subprocess.Popen([PY, "-m", "dtrain.cli", "run", "pipelines/digits_async.yaml", "--scheduler",
                              plain.address, "--run-dir", str(run_dir), "--quiet", "--set", "training.steps=10000000",
                              "--set", "cluster.scheduler_timeout_s=5", "--set", "summary.every_steps=10",
                              "--set", "cluster.jobs={ps: 1, worker: 2}"],  # (ps-1 was stopped by an earlier test)
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    assert plain.scheduler is not None
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
            assert chief.poll() is None and time.monotonic() < deadline, chief.communicate()[1][-3000:]
            time.sleep(0.1)
        os.kill(plain.scheduler.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _, err = chief.communicate(timeout=5 + 90)
            elapsed = time.monotonic() - stopped
        finally:
            os.kill(plain.scheduler.pid, signal.SIGCONT)
    finally:
        if chief.poll() is None:
            chief.kill()
            chief.communicate()
    assert chief.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("dtrain: ")]
    assert len(errors) == 1 and "does not answer" in errors[0] and "cluster.scheduler_timeout_s" in errors[0], err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "does not answer" in summary["error"], summary
    assert 5 <= elapsed < 5 + 45, f"the run ended {elapsed:.0f} s after the scheduler stopped"


def test_plain_cluster_stops_leaving_no_process(plain):
    assert not plain.shutdown()


# --------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    """certs/ (by examples/make_certs.py: a CA and a 127.0.0.1 certificate), and a foreign CA's."""
    d = tmp_path_factory.mktemp("tls")
    for sub in ("certs", "stranger"):
        out = subprocess.run([PY, str(ROOT / "examples" / "make_certs.py"), str(d / sub), "--host", "127.0.0.1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    return d


@pytest.fixture(scope="module")
def tls(tls_dir):
    cluster = start_cluster(tls_dir, certs=tls_dir / "certs")
    yield cluster
    cluster.shutdown()


def test_make_certs_makes_a_ca_signed_certificate_for_127_0_0_1(tls_dir):
    import ipaddress

    from cryptography import x509

    ca = x509.load_pem_x509_certificate((tls_dir / "certs" / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tls_dir / "certs" / "cluster.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert cert.subject.rfc4514_string() == "CN=127.0.0.1"
    assert oct((tls_dir / "certs" / "cluster-key.pem").stat().st_mode & 0o777) == "0o600"


@pytest.mark.timeout(600)
def test_digits_async_over_tls(tls, tls_dir, tmp_path):
    spec = yaml.safe_load((ROOT / "pipelines" / "digits_async.yaml").read_text())
    spec["name"] = "digits-tls"
    spec["cluster"]["scheduler"] = tls.address  # from the YAML this time, not --scheduler
    # relative to the pipeline file, which is not where dtrain runs from (cwd is the repository)
    spec["cluster"]["security"] = {"ca_file": "certs/ca.pem", "cert_file": "certs/cluster.pem",
                                   "key_file": "certs/cluster-key.pem"}
    pipeline = tls_dir / "digits_tls.yaml"
    pipeline.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = tmp_path / "run"
    out, _ = dtrain("run", str(pipeline), "--run-dir", str(run_dir), "--quiet")
    assert_trained(run_dir, tls, out)
    tasks = json.loads((run_dir / "cluster.json").read_text())["tasks"]
    assert all(t["address"].startswith("tls://") for t in tasks.values()), tasks


def _client_error(address: str, certs: Path | None = None) -> str:
    """The error a fresh process's ``distributed.Client`` gets from ``address`` (with ``certs``'
    certificate when given), as 'Type: message', or 'connected'. A process per attempt: a failed
    Client leaves its IO-loop thread behind, and the next Client in the same process sometimes
    timed out starting its own (distributed's 10 s wait), an artefact of the test, not the check."""
    sec = "None" if certs is None else (
        f"Security(tls_ca_file={str(certs / 'ca.pem')!r}, tls_client_cert={str(certs / 'cluster.pem')!r}, "
        f"tls_client_key={str(certs / 'cluster-key.pem')!r}, require_encryption=True)")
    code = ("from distributed import Client\nfrom distributed.security import Security\n"
            f"try:\n    Client({address!r}, timeout=5, set_as_default=False, security={sec})\n"
            "    print('connected')\n"
            "except BaseException as exc:\n    print(f'{type(exc).__name__}: {exc}')\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


@pytest.mark.timeout(300)
def test_tls_scheduler_refuses_connections_without_the_certificate(tls, tls_dir, tmp_path):
    tcp_address = tls.address.replace("tls://", "tcp://")
    err = _client_error(tls.address)  # no certificate at all
    assert err.startswith("TypeError") and "TLS expects a `ssl_context`" in err, err
    err = _client_error(tcp_address)  # plain TCP to the TLS port: the handshake fails, the connection is dropped
    assert err.startswith(("OSError", "CommClosedError", "TimeoutError")), err
    stranger = tls_dir / "stranger"
    err = _client_error(tls.address, stranger)  # a certificate from another CA
    assert "TLS certificate does not match" in err, err
    assert _client_error(tls.address, tls_dir / "certs") == "connected"  # the checks above can fail

    # dtrain run without cluster.security: a clear error, exit 1, nothing started
    out, _ = dtrain("run", "pipelines/digits_async.yaml", "--scheduler", tls.address,
                    "--run-dir", str(tmp_path / "run"), "--quiet", timeout=120)
    assert out.returncode == 1
    assert "uses TLS: set cluster.security" in out.stderr and "Traceback" not in out.stderr
    # a plain tcp:// client to the TLS port
    out, _ = dtrain("run", "pipelines/digits_async.yaml", "--scheduler", tcp_address,
                    "--run-dir", str(tmp_path / "run"), "--quiet", timeout=120)
    assert out.returncode == 1
    assert "closed the connection" in out.stderr and "tls://" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()

    # dtrain worker: without certificates it refuses to start (usage, exit 2); with a foreign CA's
    # certificate the scheduler refuses it (exit 1). Neither registers.
    out, _ = dtrain("worker", "--job", "ps", "--task", "7", "--scheduler", tls.address, timeout=60)
    assert out.returncode == 2 and "uses TLS" in out.stderr
    out, _ = dtrain("worker", "--job", "ps", "--task", "7", "--scheduler", tls.address, "--host", "127.0.0.1",
                    "--tls-ca-file", str(stranger / "ca.pem"), "--tls-cert", str(stranger / "cluster.pem"),
                    "--tls-key", str(stranger / "cluster-key.pem"), "--wait-s", "10", timeout=120)
    assert out.returncode == 1 and "refused the TLS connection" in out.stderr, out.stderr[-2000:]
    assert "ps-7" not in tls.worker_names()


def test_missing_security_file_is_named_before_connecting(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("name: p\ncluster:\n  jobs: {ps: 1, worker: 1}\n  scheduler: tls://127.0.0.1:1\n"
                        "  security: {ca_file: certs/ca.pem, cert_file: certs/cluster.pem}\n"
                        "model: {input_shape: [4], layers: [{type: linear, out: 1}], loss: mse}\n"
                        "data: {source: synthetic}\n")
    out, _ = dtrain("run", str(pipeline), "--run-dir", str(tmp_path / "run"), "--quiet", timeout=120)
    assert out.returncode == 1
    assert f"cluster.security.ca_file: no readable file {tmp_path / 'certs' / 'ca.pem'}" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


def test_tls_cluster_stops_leaving_no_process(tls):
    assert not tls.shutdown()


# --------------------------------------------------------------------------------- dtrain worker CLI


@pytest.mark.parametrize("args, message", [
    (["--job", "ps", "--task", "0", "--scheduler", "tcp://127.0.0.1:1", "--resources", "ps=2"], "set by --job"),
    (["--job", "ps", "--task", "0", "--scheduler", "tcp://127.0.0.1:1", "--resources", "GPU"], "NAME=NUMBER"),
    (["--job", "ps", "--task", "0", "--scheduler", "tcp://127.0.0.1:1", "--device", "tpu:0"], "expected cpu"),
    (["--job", "ps", "--task", "0", "--scheduler", "tcp://127.0.0.1:1", "--tls-ca-file", "/nonexistent.pem",
      "--tls-cert", "/nonexistent.pem"], "no such readable file"),
    (["--job", "ps", "--task", "0"], "--scheduler"),
])
def test_dtrain_worker_usage_errors_exit_2(args, message):
    out, _ = dtrain("worker", *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_dtrain_worker_unreachable_scheduler_exits_1():
    out, elapsed = dtrain("worker", "--job", "ps", "--task", "0", "--scheduler", "tcp://127.0.0.1:1",
                          "--wait-s", "2", timeout=120)
    assert out.returncode == 1
    assert "cannot reach the scheduler at tcp://127.0.0.1:1 within 2 s" in out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------------- examples/


def _descendants(pid: int) -> dict[int, float]:
    try:
        return {c.pid: c.create_time() for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


@pytest.mark.timeout(600)
def test_example_deploy_local_sh(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(ENV, STEPS="200", RUN_DIR=str(run_dir), PYTHON=PY, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "deploy_local.sh")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    seen: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 540
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(_descendants(proc.pid))
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:  # the script hung: stop it and what it started
            for pid in alive({**_descendants(proc.pid), **seen}):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] >= 200
    assert "completed at step" in stdout
    assert "started worker-1" in stderr and "stopped everything (exit 0)" in stderr
    assert len(seen) >= 5  # the scheduler and 4 worker (nanny) processes, at least
    assert not alive(seen), "the script left processes behind"
    assert not list(tmp_path.glob("dtrain-deploy.*/*.log"))  # its logs are cleaned up
