"""Where the tasks run: an embedded Dask cluster, or a running scheduler's workers.

The embedded default is a ``distributed.SpecCluster`` (LocalCluster cannot name heterogeneous
workers) with one worker per task, named ``<job>-<index>`` and tagged with the resource
``<job>=1``, everything bound to 127.0.0.1 (the dashboard included). Workers get a death timeout
so that a worker orphaned by a killed client exits by itself, and the scheduler a short
worker-ttl so that a hung worker is dropped in seconds rather than Dask's default 5 minutes.

The embedded cluster speaks TLS with a per-run certificate (``distributed.Security.temporary()``,
held only in memory): a plain ``tcp://`` scheduler on 127.0.0.1 would run pickled code for any
local user who finds its port, and only this process holds the key.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster, Worker
from distributed.security import Security

from dtrain.deploy import adaptive, forkserver, phases, plugin
from dtrain.deploy.env import (  # noqa: F401 (MALLOC_*: re-exported)
    DASK_ENV,
    HOUSEKEEPING,
    MALLOC_MMAP_THRESHOLD,
    MALLOC_TRIM_THRESHOLD,
)
from dtrain.errors import ConnectError, RunError
from dtrain.observe.scheduler import TelemetryPlugin
from dtrain.plan.assign import assign_workers, is_replica_task
from dtrain.spec.elastic import adaptive_bounds, elastic_of
from dtrain.spec.pipeline import PipelineSpec

if TYPE_CHECKING:
    from dtrain.plan.compiler import Plan

logger = logging.getLogger(__name__)

DEATH_TIMEOUT_S = 15
SCHEDULER_TIMEOUT_S = 30.0  # any single question to the scheduler (cluster.scheduler_timeout_s)


def dask_config(spec: PipelineSpec, embedded: bool = True) -> dict[str, Any]:
    """Dask settings dtrain runs with; ``embedded``: for the
    cluster dtrain starts (a cluster of the user's keeps its own way of starting processes)."""
    config = {
        "distributed.scheduler.worker-ttl": f"{spec.cluster.worker_ttl_s}s",
        # DataLoader workers and other children need non-daemonic worker processes.
        "distributed.worker.daemon": False,
        # Replicas are long tasks on purpose; do not warn every few seconds about them.
        "distributed.admin.tick.limit": "60s",
        **HOUSEKEEPING,
        "distributed.worker.profile.enabled": False,
        "distributed.scheduler.work-stealing": False,
        "distributed.admin.system-monitor.gil.enabled": False,
        **DASK_ENV,
    }
    if embedded:  # its worker processes fork from a server with torch and dtrain imported (forkserver.py)
        config[forkserver.METHOD_KEY] = spec.cluster.start_method
    return config




def worker_specs(spec: PipelineSpec, processes: bool = True, security: Any = None) -> dict[str, dict[str, Any]]:
    """The SpecCluster worker entries: one per task of every job (TLS with ``security`` when given);
    with ``cluster.adaptive``, the replicas' job starts with its ``min`` workers (Dask adds more)."""
    adaptive = adaptive_bounds(spec)
    out: dict[str, dict[str, Any]] = {}
    for job in spec.cluster.jobs:
        count = spec.cluster.num_tasks(job)
        if adaptive is not None and job == spec.placement.worker_job:
            count = adaptive[0]
        for i in range(count):
            name = f"{job}-{i}"
            entry = worker_entry(spec, job, processes, security)
            entry["options"]["name"] = name
            out[name] = entry
    return out


def worker_entry(spec: PipelineSpec, job: str, processes: bool = True, security: Any = None) -> dict[str, Any]:
    """One SpecCluster worker entry for a task of ``job``, without its name."""
    options: dict[str, Any] = {
        "nthreads": spec.cluster.nthreads, "resources": {job: 1},
        "host": "127.0.0.1", "memory_limit": spec.cluster.memory_limit, "death_timeout": DEATH_TIMEOUT_S,
    }
    if security is not None:
        options.update(security=security, protocol="tls://")
    if not processes:
        options["dashboard"] = False
        return {"cls": Worker, "options": options}
    options["dashboard_address"] = None
    # Signals meant for the chief (Ctrl-C, systemd's stop) must not end these processes
    # before it has checkpointed: see dtrain.deploy.preload.
    options["preload"] = ["dtrain.deploy.preload"]
    options["env"] = {
        "OMP_NUM_THREADS": str(spec.training.torch_threads),
        "MKL_NUM_THREADS": str(spec.training.torch_threads),
        "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
    }
    return {"cls": Nanny, "options": options}


class EmbeddedCluster(SpecCluster):
    """The embedded SpecCluster; a worker it adds (adaptive scaling) is a replica task's, named
    ``<job>-<i>`` with the lowest free ``i``, so it serves the task slot of that name."""

    def __init__(self, *args: Any, grow_job: str = "worker", **kwargs: Any):
        self.grow_job = grow_job
        super().__init__(*args, **kwargs)

    def _new_worker_name(self, worker_number: int) -> str:
        return f"{self.grow_job}-{worker_number}"

    def new_worker_spec(self) -> dict[str, Any]:
        """The lowest free name (SpecCluster's counter only grows): a slot's name again."""
        i = 0
        while self._new_worker_name(i) in self.worker_spec:
            i += 1
        return {self._new_worker_name(i): self.new_spec}


def embedded_cluster(spec: PipelineSpec, processes: bool = True) -> SpecCluster:
    """Start the embedded cluster (blocking until every worker has joined), TLS-only with a
    per-run certificate (the module docstring); its ``security`` is what a client needs."""
    security = Security.temporary() if spec.cluster.tls else None  # cluster.tls: false is plain TCP
    scheduler = {"cls": Scheduler, "options": {
        "host": "127.0.0.1", "port": 0, "protocol": "tls://" if security is not None else "tcp://",
        "security": security,
        "dashboard_address": "127.0.0.1:0",
        "dashboard": spec.cluster.dashboard,
    }}
    job = spec.placement.worker_job
    grow = worker_entry(spec, job, processes, security) if adaptive_bounds(spec) is not None else None
    if processes:
        forkserver.warm(spec, dask_config(spec))
    with dask.config.set(dask_config(spec)):
        return EmbeddedCluster(workers=worker_specs(spec, processes, security), worker=grow, grow_job=job,
                               scheduler=scheduler, name=spec.name, security=security, shutdown_on_close=True)


@dataclass
class Connection:
    """A client, the cluster it belongs to when dtrain started it, and the task -> address map."""

    client: Client
    cluster: SpecCluster | None = None
    owns_client: bool = False
    tasks: dict[str, str] = field(default_factory=dict)
    shared: tuple[str, ...] = ()  # automatic assignment: ps tasks sharing a replica's worker
    pids: dict[str, int] = field(default_factory=dict)  # worker address -> process id (cluster.json)
    adaptive: Any = None  # cluster.adaptive: the embedded cluster's ReplicaAdaptive (deploy/adaptive.py)
    scheduler_timeout_s: float = SCHEDULER_TIMEOUT_S  # cluster.scheduler_timeout_s

    @property
    def dashboard_link(self) -> str | None:
        try:
            return self.client.dashboard_link if self.cluster is None or self.cluster.scheduler_info else None
        except Exception:  # no dashboard (bokeh missing or disabled)
            return None

    def workers(self) -> dict[str, dict[str, Any]]:
        """The scheduler's current workers, asked of the scheduler itself: the client's cached
        ``scheduler_info`` is periodically refreshed and can briefly list no workers, which would
        look like lost tasks."""
        scheduler = self.client.scheduler
        assert scheduler is not None  # a connected client
        try:
            info = self.client.sync(scheduler.identity, n_workers=-1, callback_timeout=self.scheduler_timeout_s)
        except TimeoutError:
            raise RunError(f"the scheduler at {scheduler.address} does not answer (no reply in "
                           f"{self.scheduler_timeout_s:g} s: cluster.scheduler_timeout_s); is it overloaded, stopped "
                           "or frozen?") from None
        return info["workers"]

    def close(self) -> None:
        if self.owns_client:
            with contextlib.suppress(Exception):
                self.client.close(timeout=10)
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.close(timeout=20)


def wait_for_tasks(conn: Connection, spec: PipelineSpec, timeout: float, plan: Plan | None = None) -> dict[str, str]:
    """Block until a worker serves every task the plan uses (``plan``: the spec's, compiled
    here when not given); RunError naming the missing tasks otherwise."""
    from dtrain.plan.compiler import compile

    used = (plan if plan is not None else compile(spec)).used_tasks
    deadline = time.monotonic() + timeout
    while True:
        assignment = assign_workers(spec, conn.workers(), keep=conn.tasks)
        missing = [m for m in assignment.missing if m in used]
        bounds = elastic_of(spec)
        if bounds is not None:  # elastic replicas: at least min of the slots served, the rest join later
            slots = [k for k in used if is_replica_task(spec, k)]
            if sum(1 for k in slots if assignment.addresses.get(k)) >= bounds.min:
                missing = [m for m in missing if m not in slots]
        if not missing:
            if assignment.shared and assignment.shared != conn.shared:
                logger.warning("%d Dask workers for %d tasks: %s share%s a worker with a replica (cluster.assign: auto; "
                               "add workers to give every task its own)", assignment.workers, len(assignment.addresses),
                               ", ".join(assignment.shared), "s" if len(assignment.shared) == 1 else "")
            conn.shared = assignment.shared
            conn.tasks = {k: v for k, v in assignment.addresses.items() if v}
            return conn.tasks
        if time.monotonic() >= deadline:
            have = sorted(str(w.get("name")) for w in conn.workers().values())
            scheduler = conn.client.scheduler
            assert scheduler is not None  # a connected client
            if assignment.mode == "auto":
                replicas = sum(1 for m in used if is_replica_task(spec, m))
                raise RunError(
                    f"no worker for task(s) {', '.join(missing)} after waiting {timeout:.0f} s (cluster.wait_s): the "
                    f"cluster has {len(have)} worker(s) and none is named or tagged for the tasks, so they are assigned "
                    f"automatically, one replica per worker: it needs at least {max(replicas, 1)} worker(s). Scale the "
                    f"cluster up, or lower cluster.jobs.{spec.placement.worker_job}")
            raise RunError(
                f"no worker for task(s) {', '.join(missing)} after waiting {timeout:.0f} s (cluster.wait_s); "
                f"workers present: {', '.join(have) or 'none'}. Start them with "
                + "; ".join(f"`dtrain worker --job {m.split('/')[1][4:]} --task {m.split(':')[-1]} "
                            f"--scheduler {scheduler.address}`" for m in missing[:3]))
        time.sleep(0.2)


@contextlib.contextmanager
def connect(spec: PipelineSpec, client: Client | None = None, scheduler: str | None = None,
            processes: bool = True, wait: bool = True, plan: Plan | None = None) -> Iterator[Connection]:
    """The cluster for a run: the given client's, a running scheduler's, or an embedded one.
    ``wait``: block until a worker serves every task ``plan`` uses (the run's compiled plan;
    ``wait_for_tasks`` compiles the spec's when not given); without it, connect only (``dtrain
    plan --scheduler`` reads the workers there are).

    Whatever dtrain starts here it also stops, whether the run ends, fails or is interrupted.
    """
    address = scheduler or spec.cluster.scheduler
    conn: Connection
    with dask.config.set(dask_config(spec, embedded=client is None and not address)):
        if client is not None:
            conn = Connection(client, adaptive=adaptive.find(client))  # dtrain.adapt(cluster, spec) on it
        elif address:
            import json
            from pathlib import Path

            from distributed.comm.core import CommClosedError, FatalCommClosedError

            if not spec.cluster.tls:
                raise ConnectError(f"cluster.tls: false applies to the embedded cluster; the scheduler at {address} "
                                   "decides by its own address (tls:// with cluster.security): remove cluster.tls")
            security = _security(spec)
            if "://" not in address and address.endswith(".json"):
                # a scheduler file written by `dask scheduler --scheduler-file` (a shared file system)
                sched_file = Path(address).expanduser()
                if scheduler is None and not sched_file.is_absolute():
                    sched_file = spec.base_dir / sched_file  # cluster.scheduler: relative to the pipeline
                try:
                    address = str(json.loads(sched_file.read_text())["address"])
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise ConnectError(f"cannot read the scheduler address from {sched_file}: {exc}") from None
            if security is not None and "://" not in address:
                address = f"tls://{address}"
            scheme = address.split("://", 1)[0] if "://" in address else "tcp"
            if scheme == "tls" and security is None:
                raise ConnectError(f"the scheduler at {address} uses TLS: set cluster.security (ca_file, cert_file, "
                               f"key_file) to a certificate signed by the scheduler's CA (docs/deployment.md)")
            if security is not None and scheme != "tls":
                raise ConnectError(f"cluster.security is set, so every connection must be encrypted, but the "
                               f"scheduler address {address} is {scheme}://; use tls://")
            try:
                c = Client(address, timeout=spec.cluster.wait_s, direct_to_workers=True, security=security,
                           set_as_default=False)
            except FatalCommClosedError as exc:
                raise ConnectError(f"the scheduler at {address} refused the TLS connection ({exc}); is "
                               f"cluster.security.cert_file signed by the CA the scheduler trusts, and ca_file "
                               f"the CA that signed the scheduler's certificate?") from None
            except CommClosedError as exc:
                hint = "; if it uses TLS, give its tls:// address and set cluster.security" if scheme == "tcp" else ""
                raise ConnectError(f"the scheduler at {address} closed the connection ({exc}){hint}") from None
            except OSError as exc:
                raise ConnectError(f"cannot reach the scheduler at {address} within {spec.cluster.wait_s:g} s "
                               f"(cluster.wait_s): {exc}. Is `dask scheduler` running there, and its port open "
                               f"to this machine?") from None
            except ValueError as exc:  # a malformed address
                raise ConnectError(f"bad scheduler address {address!r}: {exc}") from None
            conn = Connection(c, owns_client=True)
        else:
            cluster = embedded_cluster(spec, processes=processes)
            phases.mark("embedded cluster: scheduler, worker processes")
            try:
                c = Client(cluster, direct_to_workers=True, security=cluster.security, set_as_default=False)
            except BaseException:
                cluster.close()
                raise
            conn = Connection(c, cluster=cluster, owns_client=True, adaptive=adaptive.start(cluster, spec))
        conn.scheduler_timeout_s = spec.cluster.scheduler_timeout_s
        try:
            if wait:
                plugin.register(conn.client)  # the cluster's own scaling keeps the ps and replicas (plugin.py)
                if spec.observe.telemetry:  # dtrain_* series on /metrics, the dashboard's /dtrain page
                    plugin.register(conn.client, TelemetryPlugin(), "no dtrain_* series on its /metrics, no /dtrain page")
                wait_for_tasks(conn, spec, spec.cluster.wait_s, plan)
                phases.mark("connected: a worker for every task")
            yield conn
        finally:
            conn.close()


def security_paths(spec: PipelineSpec) -> dict[str, str | None] | None:
    """``cluster.security``'s files as absolute paths (relative ones are relative to the pipeline)."""
    sec = spec.cluster.security
    if sec is None:
        return None

    def path(p: str | None) -> str | None:
        return None if p is None else str(p if p.startswith("/") else spec.base_dir / p)

    return {"ca_file": path(sec.ca_file), "cert_file": path(sec.cert_file), "key_file": path(sec.key_file)}


def _security(spec: PipelineSpec) -> Any:
    """``cluster.security`` as a client-side ``distributed.Security`` that refuses unencrypted comms.

    Relative paths are relative to the pipeline file (``security_paths``); a missing file is a
    RunError naming the field, raised before any connection is tried.
    """
    import os

    paths = security_paths(spec)
    if paths is None:
        return None
    from distributed.security import Security

    for key, p in paths.items():
        if p is not None and not (os.path.isfile(p) and os.access(p, os.R_OK)):
            raise ConnectError(f"cluster.security.{key}: no readable file {p} "
                           f"(relative paths are relative to the pipeline file)")
    return Security(tls_ca_file=paths["ca_file"], tls_client_cert=paths["cert_file"],
                    tls_client_key=paths["key_file"], require_encryption=True)
