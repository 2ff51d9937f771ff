"""dtrain deployed across the lab as on separate machines: ``dask scheduler`` on host
``scheduler``, one ``dtrain worker`` per task on its own host (``ps0``, ``worker1``...), and
``dtrain run --scheduler`` from host ``client``; with or without TLS (one CA, one certificate for
every lab address, made by examples/make_certs.py).

Every process runs from this repository's root with ``PYTHONPATH`` set to it (the hosts share the
file system, as machines with a shared home directory do), and logs to ``workdir/<name>.log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .network import Host, Lab

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PORT = 8786
WORKER_TTL = "10s"  # a partitioned worker is dropped after this (docs/deployment.md, worker-ttl)


def host_names(tasks: Iterable[tuple[str, int]]) -> list[str]:
    """The lab hosts a deployment of ``tasks`` needs: scheduler, client and one per task."""
    return ["scheduler", "client", *(f"{job}{i}" for job, i in tasks)]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


class LabCluster:
    """The scheduler and one ``dtrain worker`` per task in ``tasks``, each on its lab host."""

    def __init__(self, lab: Lab, tasks: Sequence[tuple[str, int]], workdir: Path, tls: bool = False,
                 worker_ttl: str = WORKER_TTL):
        self.lab = lab
        self.tasks = list(tasks)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tls = tls
        self.worker_ttl = worker_ttl
        self.certs = self.workdir / "certs"
        self.scheme = "tls" if tls else "tcp"
        self.address = f"{self.scheme}://{lab['scheduler'].address}:{PORT}"
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ starting
    def tls_flags(self) -> list[str]:
        if not self.tls:
            return []
        return ["--tls-ca-file", str(self.certs / "ca.pem"), "--tls-cert", str(self.certs / "cluster.pem"),
                "--tls-key", str(self.certs / "cluster-key.pem")]

    def security(self) -> dict[str, str] | None:
        """``cluster.security`` for a pipeline run against this cluster (None without TLS)."""
        if not self.tls:
            return None
        return {"ca_file": str(self.certs / "ca.pem"), "cert_file": str(self.certs / "cluster.pem"),
                "key_file": str(self.certs / "cluster-key.pem")}

    def _popen(self, host: Host, name: str, argv: list[str], **extra_env: str) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = host.popen(argv, cwd=str(ROOT), env=env(**extra_env), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def log(self, name: str, n: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def start(self, timeout: float = 120.0) -> LabCluster:
        if self.tls:
            hosts = [a for h in self.lab.hosts.values() for a in ("--host", h.address)]
            subprocess.run([PY, str(ROOT / "examples" / "make_certs.py"), str(self.certs), *hosts], check=True,
                           capture_output=True, env=env())
        sched = self.lab["scheduler"]
        self._popen(sched, "scheduler", [PY, "-m", "dask", "scheduler", "--host", sched.address, "--port", str(PORT),
                                         "--no-dashboard", "--dashboard-address", f"{sched.address}:0",
                                         *self.tls_flags()],
                    DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL=self.worker_ttl)
        for job, i in self.tasks:
            self.start_worker(job, i)
        self.wait_for({f"{job}-{i}" for job, i in self.tasks}, timeout)
        return self

    def start_worker(self, job: str, i: int) -> subprocess.Popen:
        host = self.lab[f"{job}{i}"]
        return self._popen(host, f"{job}-{i}", [
            PY, "-m", "dtrain.cli", "worker", "--job", job, "--task", str(i), "--scheduler", self.address,
            "--host", host.address, "--nthreads", "2", "--memory-limit", "2GiB", *self.tls_flags()])

    def workers(self) -> dict[str, Any]:
        """The scheduler's view, asked from the client host: {name: {address, resources}}."""
        return dict(self.ask("w = c.scheduler_info(n_workers=-1)['workers']\n"
                             "out = {str(v['name']): {'address': a, 'resources': v['resources']} "
                             "for a, v in w.items()}"))

    def ask(self, body: str, host: str = "client", timeout: float = 60) -> Any:
        """Run ``body`` (Python, with a connected ``Client`` as ``c``, ending in ``out = ...``) on
        ``host`` and return ``out`` (JSON). Ask from another host than ``client`` when that one is
        cut off (``lab.partition("client")``)."""
        sec = "None"
        if self.tls:
            c = self.certs
            sec = (f"Security(tls_ca_file={str(c / 'ca.pem')!r}, tls_client_cert={str(c / 'cluster.pem')!r}, "
                   f"tls_client_key={str(c / 'cluster-key.pem')!r}, require_encryption=True)")
        code = ("import json\nfrom distributed import Client\nfrom distributed.security import Security\n"
                f"with Client({self.address!r}, security={sec}, timeout=30, set_as_default=False) as c:\n"
                + "".join(f"    {line}\n" for line in body.splitlines())
                + "print(json.dumps(out, default=str))\n")
        proc = self.lab[host].run([PY, "-c", code], cwd=str(ROOT), env=env(), timeout=timeout)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def events(self, topic: str, host: str = "client") -> list[tuple[float, Any]]:
        """The scheduler's events of ``topic``: [(time, message)], oldest first."""
        return [(float(t), m) for t, m in self.ask(f"out = c.get_events({topic!r})", host)]

    def wait_for(self, names: set[str], timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.startswith("run"):  # (a run may have ended)
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            have = self.workers()
            if names <= set(have):
                return have
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {sorted(names - set(have))} did not join in {timeout:g} s")
            time.sleep(0.5)

    # ------------------------------------------------------------------ running
    def run(self, spec: dict[str, Any], run_dir: Path, sets: Sequence[str] = (), name: str = "run",
            resume: bool = False) -> subprocess.Popen:
        """Start ``dtrain run SPEC --scheduler ADDRESS`` (with ``--resume``) on the client host
        (returns the process; its output goes to ``workdir/NAME.log``)."""
        spec = dict(spec)
        cluster = dict(spec.get("cluster") or {})
        if self.tls:
            cluster["security"] = self.security()
        spec["cluster"] = cluster
        path = self.workdir / f"{name}.yaml"
        import yaml

        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        argv = [PY, "-m", "dtrain.cli", "run", str(path), "--scheduler", self.address, "--run-dir", str(run_dir),
                "--quiet", *(["--resume"] if resume else []), *(a for kv in sets for a in ("--set", kv))]
        return self._popen(self.lab["client"], name, argv)

    def run_to_end(self, spec: dict[str, Any], run_dir: Path, sets: Sequence[str] = (), timeout: float = 300.0,
                   name: str = "run") -> tuple[int, dict[str, Any] | None]:
        """:meth:`run` and wait; (exit code, summary.json or None)."""
        proc = self.run(spec, run_dir, sets, name)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            Host.stop(proc)
            rc = -1
        try:
            summary = json.loads((Path(run_dir) / "summary.json").read_text())
        except (OSError, ValueError):
            summary = None
        return rc, summary

    # ------------------------------------------------------------------ stopping
    def stop(self, name: str, grace_s: float = 10.0) -> int | None:
        return Host.stop(self.procs[name], grace_s)

    def close(self) -> None:
        """Workers, then the scheduler, by process group (the lab's teardown would end them too)."""
        for name in [n for n in self.procs if n != "scheduler"]:
            Host.stop(self.procs[name], 10.0)
        if "scheduler" in self.procs:
            Host.stop(self.procs["scheduler"], 10.0)

    def __enter__(self) -> LabCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
