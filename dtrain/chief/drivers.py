"""In-graph replication's step drivers, chosen: the one module that knows all three
(``ingraph.py``, the base and sync one graph per step; ``ingraph_tower_driver.py``, sync towers;
``ingraph_async.py``, async towers), so that the subclasses import their base and the base none
of them."""

from __future__ import annotations

from distributed import Client

from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

from .ingraph import InGraphDriver
from .ingraph_async import AsyncInGraphDriver
from .ingraph_tower_driver import TowerDriver, uses_towers


def new_driver(client: Client, spec: PipelineSpec, plan: Plan, shard_refs: list[tuple[str, str]], tasks: dict[str, str],
               token: str, local_steps: dict[int, int] | None = None) -> InGraphDriver:
    """The step driver for ``training.mode``. Sync: towers driven step by step over the socket
    data plane (``dtrain.chief.ingraph_tower_driver``) where it can (``transport: socket``, every replica
    in every step), else one graph per global step (this module). Async: one graph per tower step
    with towers running independently (``dtrain.chief.ingraph_async``), where ``local_steps``
    (replica index -> steps it pushed, from a checkpoint) is where each tower resumes in its data
    order."""
    if spec.training.mode == "async":
        return AsyncInGraphDriver(client, spec, plan, shard_refs, tasks, token, local_steps)
    if uses_towers(spec, plan):
        return TowerDriver(client, spec, plan, shard_refs, tasks, token)
    return InGraphDriver(client, spec, plan, shard_refs, tasks, token)
