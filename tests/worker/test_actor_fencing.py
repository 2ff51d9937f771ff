"""Fencing on the actor transport (``training.transport: dask``), on the in-process cluster with a
real ParameterShard actor: a replica's pushes carry its submission (attempt), and a shard whose
replica index the session gave to another attempt (a resubmission, or an elastic leave) refuses
them, as the socket data plane does."""

from __future__ import annotations

import pytest
import torch

from dtrain.chief.elastic import FENCED
from dtrain.ps.shard import ParameterShard
from dtrain.ps.sync_push import FencedOff


def _push(refs: list[tuple[str, str]], attempt: int, mode: str) -> int:
    """One push of replica 0's ``attempt``, through the handles a replica task builds; the step."""
    from dtrain.worker.tasks import shard_handles

    (shard,) = shard_handles(refs, attempt)
    push = shard.push_pull if mode == "async" else shard.push_sync
    return push(torch.ones(10), 0, 0, 0.1, 4, 1).result(timeout=20)[1]


def _address(client, name: str) -> str:
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_replaced_attempt_cannot_push_over_actor_calls(inproc_client, mode):
    client = inproc_client
    ps, worker = _address(client, "ps-2"), _address(client, "worker-3")
    config = {"index": 0, "mode": mode, "steps": 100, "num_replicas": 1, "barrier_timeout_s": 10,
              "optimizer": {"name": "sgd", "lr": 0.5}}
    with client.as_current():  # (the actor proxy's calls go through this client)
        future = client.submit(ParameterShard, config, torch.ones(10), actor=True, workers=[ps], pure=False)
        shard = future.result(timeout=30)
        refs = [(ps, future.key)]

        def push(attempt: int) -> int:
            return client.submit(_push, refs, attempt, mode, workers=[worker], pure=False).result(timeout=60)

        try:
            shard.set_owner(0, 2).result(timeout=10)  # the session resubmitted replica 0 (attempt 2)
            with pytest.raises(FencedOff, match="attempt 1 is fenced off: attempt 2 owns"):
                push(1)  # the replaced attempt 1 thawed
            params, step = shard.pull(0).result(timeout=10)[:2]
            assert step == 0 and torch.equal(params, torch.ones(10))  # nothing applied
            assert push(2) == 1  # the owner trains
            shard.set_owner(0, FENCED).result(timeout=10)  # its worker left (elastic): fenced off
            with pytest.raises(FencedOff, match=f"attempt 2 is fenced off: attempt {FENCED} owns"):
                push(2)
            assert shard.current_step().result(timeout=10) == 1
        finally:
            del shard
            future.release()
