"""Which Dask worker serves each task. Pure: the scheduler's view of its workers in, a map out.

Two ways (``cluster.assign``):

- **named**: a task is served by the worker named as ``cluster.jobs`` expects (``J-i``, or the
  name or address listed for the task), a worker on a listed bare host, or one tagged with the
  resource ``J`` (what ``dtrain worker`` and the embedded cluster start);
- **auto** (the default): the same, and when no worker of the cluster is named, listed or tagged
  for any of the pipeline's tasks (a ``LocalCluster``, dask-jobqueue, dask-kubernetes, a cloud
  service, as they come), the tasks are assigned to the workers there are, by address: the tasks
  of jobs other than the replicas' (the ps tasks) first, spread over distinct hosts, then one
  replica task per remaining worker. With fewer workers than tasks a ps task shares a worker with
  a replica (``Assignment.shared`` names it, and the session warns), never two replicas one
  worker. Assignments already made (``keep``) stay while their worker lives, so a recovery or a
  re-plan never moves a live ps shard.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dtrain.spec.elastic import elastic_of
from dtrain.spec.pipeline import PipelineSpec


@dataclass(frozen=True)
class Assignment:
    """Task key ("/job:ps/task:0") -> worker address (None: no worker yet), and how it was made."""

    addresses: dict[str, str | None]
    mode: str  # "named" or "auto" (the rule that served the tasks); "" with no workers to assign
    shared: tuple[str, ...] = ()  # auto: ps tasks sharing a worker with a replica task
    workers: int = 0  # the workers the scheduler reported

    @property
    def missing(self) -> list[str]:
        """Tasks without a worker (none before there is a cluster to assign from)."""
        return [k for k, v in self.addresses.items() if v is None] if self.mode else []


def task_host(address: str) -> str:
    """The host of a worker address (``tcp://[::1]:4000`` -> ``::1``)."""
    return address.split("://")[-1].rsplit(":", 1)[0].strip("[]")


def is_replica_task(spec: PipelineSpec, key: str) -> bool:
    """Whether task ``key`` ("/job:worker/task:3") belongs to the job whose tasks run replicas."""
    return not spec.is_graph and key.startswith(f"/job:{spec.placement.worker_job}/")


def _strip_scheme(address: str) -> str:
    return address.split("://", 1)[-1]


def _natural(text: str) -> tuple[Any, ...]:
    """Sort key putting "worker-2" before "worker-10" (and Dask's names 0, 1, ..., 10 in order)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _infos(workers: Iterable[Any] | Mapping[str, Any]) -> list[dict[str, Any]]:
    infos: list[dict[str, Any]] = []
    items: Iterable[tuple[Any, Any]]
    if isinstance(workers, Mapping):
        items = workers.items()
    else:
        listed: Iterable[Any] = workers  # scheduler_info()'s worker dicts
        items = ((w.get("address"), w) for w in listed)
    for addr, info in items:
        addr = addr or info.get("address")
        if not addr:
            continue  # a worker without an address cannot be pinned to
        infos.append({"address": str(addr), "name": str(info.get("name", "")),
                      "resources": dict(info.get("resources") or {})})
    infos.sort(key=lambda w: (_natural(w["name"]), _natural(w["address"])))  # whatever the scheduler's order
    return infos


def assign_workers(spec: PipelineSpec, workers: Iterable[Any] | Mapping[str, Any] | None,
                   keep: Mapping[str, str] | None = None) -> Assignment:
    """Map every task to a worker address (the module docstring).

    ``workers`` is the scheduler's view: ``identity()["workers"]`` (address -> info with ``name``
    and ``resources``), or a list of such infos (each with its ``address``), or ``None`` (nothing
    resolved: the plan shows worker names only). ``keep``: an earlier automatic assignment, kept
    for the tasks whose worker is still there.
    """
    tasks = [(job, i, spec.cluster.task_workers(job)[i])
             for job in spec.cluster.jobs for i in range(spec.cluster.num_tasks(job))]
    out: dict[str, str | None] = {f"/job:{j}/task:{i}": None for j, i, _ in tasks}
    if workers is None:
        return Assignment(out, "")
    infos = _infos(workers)
    _named(tasks, infos, out)
    if spec.cluster.assign == "named" or any(out.values()):
        return Assignment(out, "named", workers=len(infos))
    return _auto(spec, infos, out, keep or {})


def _named(tasks: list[tuple[str, int, str]], infos: list[dict[str, Any]], out: dict[str, str | None]) -> None:
    """By name or listed address, then by listed bare host, then by job resource. Each pass runs
    over every task before the next starts, so a worker that a later task names exactly is never
    taken by an earlier task's host or resource match."""
    claimed: set[str] = set()

    def claim(key: str, addr: str | None) -> None:
        if addr is not None:
            out[key] = addr
            claimed.add(addr)

    for job, i, expected in tasks:
        claim(f"/job:{job}/task:{i}",
              next((w["address"] for w in infos if expected in (w["name"], w["address"], _strip_scheme(w["address"]))),
                   None))
    for job, i, expected in tasks:
        key = f"/job:{job}/task:{i}"
        if out[key] is None and "://" not in expected and ":" not in expected:
            claim(key, next((w["address"] for w in infos
                             if w["address"] not in claimed and _host(w["address"]) == expected), None))
    for job, i, _ in tasks:
        key = f"/job:{job}/task:{i}"
        if out[key] is None:
            claim(key, next((w["address"] for w in infos
                             if w["resources"].get(job) and w["address"] not in claimed), None))


def _auto(spec: PipelineSpec, infos: list[dict[str, Any]], out: dict[str, str | None],
          keep: Mapping[str, str]) -> Assignment:
    live = {w["address"] for w in infos}
    for key, addr in keep.items():
        if key in out and addr in live:
            out[key] = addr
    replica_keys = [k for k in out if is_replica_task(spec, k)]
    other_keys = [k for k in out if k not in replica_keys]
    replica_held = {out[k] for k in replica_keys if out[k]}
    used = {a for a in out.values() if a}

    def free() -> list[dict[str, Any]]:
        return [w for w in infos if w["address"] not in used]

    # ps tasks first, each on the host with the fewest ps tasks so far, while enough workers stay free
    # for the replica tasks still without one.
    replicas_waiting = sum(1 for k in replica_keys if out[k] is None)
    bounds = elastic_of(spec)
    if bounds is not None:  # elastic: the ps tasks need their own workers beside min replicas only
        replicas_waiting = max(0, bounds.min - sum(1 for k in replica_keys if out[k] is not None))
    shared: list[str] = []
    for key in other_keys:
        if out[key] is not None:
            continue
        candidates = free()
        if len(candidates) > replicas_waiting:
            load = {task_host(w["address"]): 0 for w in candidates}
            for k in other_keys:
                at = out[k]
                if at and task_host(at) in load:
                    load[task_host(at)] += 1
            best = min(candidates, key=lambda w: load[task_host(w["address"])])
            out[key] = best["address"]
            used.add(best["address"])
        else:
            shared.append(key)
    for key in replica_keys:
        if out[key] is None and free():
            out[key] = free()[0]["address"]
            used.add(out[key])  # type: ignore[arg-type]
            replica_held.add(out[key])
    # Too few workers: the ps tasks left share the replicas' workers (round robin), never a replica
    # another replica's.
    hosts = sorted(replica_held or live, key=_natural)  # (worker addresses)
    for n, key in enumerate(shared):
        if hosts:
            out[key] = hosts[n % len(hosts)]
    return Assignment(out, "auto", shared=tuple(k for k in shared if out[k]), workers=len(infos))


def resolve_workers(spec: PipelineSpec, workers: Iterable[Any] | Mapping[str, Any] | None,
                    keep: Mapping[str, str] | None = None) -> tuple[dict[str, str | None], list[str]]:
    """(task -> address or None, missing task keys): ``assign_workers`` in short."""
    a = assign_workers(spec, workers, keep)
    return a.addresses, a.missing


def _host(address: str) -> str:
    return _strip_scheme(address).rsplit(":", 1)[0]
