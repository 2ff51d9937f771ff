"""Graph pipelines: variables and ops evaluated as a Dask graph, one task per node.

``build_graph`` turns a compiled Plan into ``client.submit`` calls: every variable and op is one
task pinned to its task's worker by *address* (``workers=[address], allow_other_workers=False``);
inputs that name nodes are passed as futures, so values move worker -> worker as Dask moves
them, and number literals are constants. Like TF's ``Session.run(fetches)``, only the nodes the
fetched names depend on are evaluated (every node when nothing is fetched). The op math
lives in ``dtrain.graph.ops``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch

from dtrain.errors import ConnectError, RunError
from dtrain.graph.initializers import initialize
from dtrain.graph.ops import OpError, apply_op, to_python, to_tensor
from dtrain.plan.compiler import Plan
from dtrain.spec.errors import SpecError
from dtrain.spec.pipeline import PipelineSpec

logger = logging.getLogger(__name__)


def _torch_device(device: str, soft: bool) -> torch.device:
    """The torch device of a DeviceSpec string; a missing GPU falls back to CPU when ``soft``."""
    from dtrain.spec.device import DeviceSpec

    dev = DeviceSpec.from_string(device)
    if (dev.device_type or "CPU").upper() != "GPU":
        return torch.device("cpu")
    if torch.cuda.is_available() and (dev.device_index or 0) < torch.cuda.device_count():
        return torch.device("cuda", dev.device_index or 0)
    if soft:
        return torch.device("cpu")
    raise ValueError(f"{device} asks for a GPU this worker does not have (placement.soft is false)")


def _node_task(name: str, op: str, args: list[Any], device: str, soft: bool) -> tuple[torch.Tensor | str, str]:
    """Runs on the pinned worker. ``args``: the variable's value (a number, list, string, or
    {initializer, shape}), or inputs where upstream nodes arrive as (value, worker) tuples.
    Returns (value, name of the worker that ran it)."""
    from distributed import get_worker

    where = str(get_worker().name)
    try:
        dev = _torch_device(device, soft)
        value: torch.Tensor | str
        if op == "variable" and isinstance(args[0], str):
            return args[0], where  # a string constant
        if op == "variable" and isinstance(args[0], dict):
            value = initialize(args[0]["initializer"], args[0]["shape"], dev)
        elif op == "variable":
            value = to_tensor(args[0], dev)
        else:
            value = apply_op(op, [a[0] if isinstance(a, tuple) else a for a in args], dev)
    except Exception as exc:
        raise OpError(f"{op} {name!r} failed on {where} ({device}): {exc}") from None
    return (value if isinstance(value, str) else value.cpu()), where


def _worker_name(result: tuple[torch.Tensor | str, str]) -> str:
    return result[1]


def _needed(plan: Plan) -> list[Any]:
    """The nodes the fetched names depend on, in plan order (all of them when nothing is fetched)."""
    by_name = {o.name: o for o in plan.ops}
    if not plan.fetch:
        return list(plan.ops)
    need: set[str] = set()
    stack = list(plan.fetch)
    while stack:
        name = stack.pop()
        if name not in need:
            need.add(name)
            stack.extend(i for i in by_name[name].inputs if isinstance(i, str))
    return [o for o in plan.ops if o.name in need]


def build_graph(plan: Plan, client: Any, soft: bool = True) -> dict[str, Any]:
    """Submit one pinned task per needed node; returns node name -> Future of (tensor, worker)."""
    token = uuid.uuid4().hex[:8]
    futures: dict[str, Any] = {}
    for node in _needed(plan):
        if node.address is None:
            raise RunError(f"no worker address for {node.name!r} ({node.device}); compile with the cluster's workers")
        args = [node.value] if node.op == "variable" else \
            [futures[i] if isinstance(i, str) else float(i) for i in node.inputs]
        futures[node.name] = client.submit(
            _node_task, node.name, node.op, args, node.device, soft,
            key=f"dtrain-graph-{plan.name}-{node.name}-{token}", workers=[node.address],
            allow_other_workers=False, pure=False)
    return futures


def run_graph(spec: PipelineSpec, client: Any = None, scheduler: str | None = None, processes: bool = True,
              run_dir: Any = None) -> Any:
    """Evaluate a graph pipeline on its cluster; Result with ``fetched`` and a placement record
    (also written to ``run_dir/summary.json`` when a run directory is given, on failure too)."""
    from pathlib import Path

    from dtrain.chief.rundir import Result, describe_exit, write_json

    t0 = time.monotonic()
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        summary, fetched, plan = _evaluate(spec, client, scheduler, processes, t0)
    except BaseException as exc:
        if run_dir is not None and not isinstance(exc, (SpecError, ConnectError)):
            status, error = describe_exit(exc)
            try:
                write_json(Path(run_dir) / "summary.json", {"name": spec.name, "status": status, "error": error,
                                                            "wall_s": round(time.monotonic() - t0, 3)})
            except OSError as write_exc:
                logger.error("could not write %s: %s", Path(run_dir) / "summary.json", write_exc)
        raise
    if run_dir is not None:
        write_json(Path(run_dir) / "summary.json", summary)
    return Result(summary=summary, fetched=fetched, plan=plan, run_dir=run_dir)


def _evaluate(spec: PipelineSpec, client: Any, scheduler: str | None, processes: bool, t0: float
              ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    from distributed import wait

    from dtrain.deploy.cluster import connect
    from dtrain.plan.compiler import compile, on_workers

    # Graph nodes are small: a result that takes longer than this waits on a lost worker.
    timeout = spec.training.call_timeout_s + spec.cluster.wait_s
    compiled = compile(spec)  # once: connecting waits for the tasks it uses, then it goes on their workers
    with connect(spec, client=client, scheduler=scheduler, processes=processes, plan=compiled) as conn:
        plan = on_workers(compiled, spec, conn.workers())
        if plan.missing_tasks:
            raise RunError("no worker for task(s) " + ", ".join(plan.missing_tasks))
        futures = build_graph(plan, conn.client, soft=spec.placement.soft)
        # Fetched values come back to the client; the other nodes only report their worker name.
        address = {o.name: o.address for o in plan.ops}
        where = {name: conn.client.submit(_worker_name, fut, workers=[address[name]], allow_other_workers=False,
                                          pure=False)
                 for name, fut in futures.items() if name not in plan.fetch}
        try:
            with conn.client.as_current():  # wait() asks for the current client (not made the default)
                wait([*futures.values(), *where.values()], timeout=timeout)
            got = conn.client.gather([futures[n] for n in plan.fetch])
            names = dict(zip(where, conn.client.gather(list(where.values())), strict=True))
        except OpError as exc:
            raise RunError(f"graph {spec.name}: {exc}") from None
        except TimeoutError:
            raise RunError(f"graph {spec.name}: no result in {timeout:.0f} s (training.call_timeout_s + "
                           "cluster.wait_s); is a worker lost?") from None
        except Exception as exc:
            raise RunError(f"graph {spec.name} failed: {type(exc).__name__}: {exc}") from None
        finally:
            conn.client.cancel(list(futures.values()) + list(where.values()))
    fetched = {n: to_python(v) for n, (v, _) in zip(plan.fetch, got, strict=True)}
    names.update({n: w for n, (_, w) in zip(plan.fetch, got, strict=True)})
    placement = {o.name: names[o.name] for o in plan.ops if o.name in names}
    summary = {"name": spec.name, "status": "completed", "fetched": fetched, "placement": placement,
               "devices": {o.name: o.device for o in plan.ops if o.name in names},
               "nodes": len(futures), "wall_s": round(time.monotonic() - t0, 3)}
    return summary, fetched, plan
