"""In-graph replication's tests' shared parts (tests/chief/test_ingraph*.py): the pipeline, the
run's ps actors without a session, the driver the session would start, what the shards hold."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import torch

import dtrain
from dtrain.chief.drivers import new_driver
from dtrain.chief.ingraph import InGraphDriver
from dtrain.chief.ps_shards import ShardGroup
from dtrain.deploy.cluster import Connection, wait_for_tasks
from dtrain.plan.layout import ShardLayout
from tests.helpers.pipelines import OPTIMIZERS, mlp, pipeline_yaml

TOLERANCE = 1e-5


def in_graph_spec(num_ps: int, replicas: int, steps: int, optimizer: str = "sgd", model: dict | None = None,
                  training: dict | None = None, **sections: Any) -> dtrain.PipelineSpec:
    """In-graph sync on the digits MLP (batch 8, seed 5); ``training`` adds to its training
    section, ``sections`` (``checkpoint=...``) to the pipeline."""
    return dtrain.loads(pipeline_yaml(
        "in-graph", jobs={"ps": num_ps, "worker": replicas}, model=model or mlp(),
        data={"source": "sklearn:digits", "batch_size": 8}, optimizer=OPTIMIZERS[optimizer],
        training={"replication": "in_graph", "mode": "sync", "steps": steps, "seed": 5, "call_timeout_s": 30,
                  **(training or {})},
        summary={"every_steps": 50, "tensorboard": False}, **sections), base_dir=".")


@contextlib.contextmanager
def shards_for(client, spec: dtrain.PipelineSpec, tmp_path) -> Iterator[ShardGroup]:
    """The run's ps actors, created and initialised as ``Session.run`` does, then removed."""
    conn = Connection(client)
    wait_for_tasks(conn, spec, 30)
    with client.as_current():
        plan = dtrain.compile(spec, conn.workers())
        group = ShardGroup(conn, spec, plan, token=uuid.uuid4().hex[:8])
        group.create(ShardLayout.from_plan(plan).pack(dict(dtrain.build_model(spec).named_parameters())))
        try:
            yield group
        finally:
            group.request_stop()
            group.stop_renewing()
            client.cancel(group.futures, force=True)


def driver_for(group: ShardGroup, spec: dtrain.PipelineSpec | None = None) -> InGraphDriver:
    """The driver the session would start (towers on the socket data plane, else one graph per step)."""
    return new_driver(group.client, spec or group.spec, group.plan, group.refs(), group.conn.tasks, group.token)


def trained_model(group: ShardGroup) -> torch.nn.Module:
    model = dtrain.build_model(group.spec)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    model.load_state_dict(ShardLayout.from_plan(group.plan).unpack(group.pull_params(), shapes))
    return model


def shard_steps(group: ShardGroup) -> list[int]:
    return [s.get_params().result(timeout=10)[1] for s in group.handles]
