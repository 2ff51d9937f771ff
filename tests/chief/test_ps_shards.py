"""The chief's ShardGroup on real ParameterShard actors of the in-process Dask cluster: an
interrupt's snapshot holds every shard at one step before stopping them; ``level`` completes or
reports a half-pushed step; a restore refuses what it cannot map; a lapsed lease stops the shards."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.chief.checkpoint import Checkpoint
from dtrain.chief.ps_shards import ShardGroup, checkpoint_layout
from dtrain.errors import RunError
from dtrain.ps.part_writer import read_part_file
from dtrain.ps.shard import ParameterShard
from tests.helpers.waiting import wait_until

SPEC = """
name: shards
cluster: {jobs: {ps: 2, worker: 1}}
model:
  input_shape: [4]
  layers: [{type: linear, out: 3}, {type: relu}, {type: linear, out: 2}]
data: {source: synthetic, num_samples: 64, num_classes: 2, batch_size: 8}
optimizer: {name: sgd, lr: 0.1}
training: {mode: sync, steps: 100, barrier_timeout_s: 5}
"""


@contextlib.contextmanager
def group_of(client, spec: dtrain.PipelineSpec):
    """A ShardGroup of real actors on the in-process cluster's ps workers (as a run creates them),
    and the actors themselves (they live in this process: their state is read, never set, here)."""
    from dtrain.deploy.cluster import connect

    plan = dtrain.compile(spec)
    with connect(spec, client=client) as conn, conn.client.as_current():
        group = ShardGroup(conn, spec, plan, token=f"shards{time.monotonic_ns()}")
        try:
            group.create([torch.zeros(s.numel) for s in plan.shards])
            workers = client.cluster.workers
            shards = [next(w.state.actors[f.key] for w in workers.values() if f.key in w.state.actors)
                      for f in group.futures]
            assert all(isinstance(s, ParameterShard) for s in shards)
            yield group, shards
        finally:
            group.close_data_plane()
            group.stop_renewing()
            client.cancel(group.futures, force=True)


def test_an_interrupt_snapshot_holds_every_shard_at_one_step_before_stopping(inproc_client, tmp_path):
    """A replica has pushed step 0 to shard 1 (applied: step 1) but not yet to shard 0 when the
    interrupt comes: the checkpoint must wait for that push and stop both shards at step 1, each
    writing its part there (stopping first, as the interrupt path once did, left shard 0 at 0 and
    shard 1 at 1: a checkpoint no resume can start from)."""
    spec = dtrain.loads(SPEC, base_dir=".")
    with group_of(inproc_client, spec) as (group, shards):
        grads = [torch.ones(s.numel) for s in group.plan.shards]
        assert group.handles[1].push_sync(grads[1], 0, 0, None, 8, 1).result(5)[1] == 1
        result: dict = {}

        def interrupt() -> None:
            result["written"] = group.write_parts(lambda step: tmp_path / f"ckpt-{step:08d}", stop=True)

        chief = threading.Thread(target=interrupt)
        chief.start()
        # The chief holds every shard at step 1 and waits for shard 0 to get there.
        wait_until(lambda: shards[0].hold_at == 1 or not chief.is_alive(), 30, "the chief holding shard 0", every=0.01)
        assert chief.is_alive() and shards[0].step == 0
        assert group.handles[0].push_sync(grads[0], 0, 0, 0.5, 8, 1).result(5)[1] == 1
        chief.join(30)
        step, directory = result["written"]
        assert step == 1 and directory == tmp_path / "ckpt-00000001"
        parts = group.parts_written(directory, wait=True)
        assert [read_part_file(directory / p["file"], p["bytes"], p["sha256"])["step"] for p in parts] == [1, 1]
        assert all(s.stop for s in shards) and all(s.hold_at is None for s in shards)
        # stopped: the next step's pushes are refused, on every shard
        for h, g in zip(group.handles, grads, strict=True):
            assert h.push_sync(g, 0, 1, 0.5, 8, 2).result(5)[1:3] == (1, True)


def test_level_completes_a_half_pushed_step_with_the_other_replicas_gradients(inproc_client):
    """Replica 1 pushed step 0 to both shards, replica 0 (then lost) to shard 1 only: shard 1 applied
    step 1, shard 0 waits for replica 0. ``level`` excuses it there: shard 0 applies replica 1's
    gradient alone, and both shards are at step 1 (the recovery then resubmits only replica 0)."""
    spec = dtrain.loads(SPEC.replace("worker: 1", "worker: 2"), base_dir=".")
    with group_of(inproc_client, spec) as (group, shards):
        grads = [torch.ones(s.numel) for s in group.plan.shards]
        waiting = group.handles[0].push_sync(grads[0], 1, 0, 0.5, 8, 1)
        group.handles[1].push_sync(grads[1], 1, 0, None, 0, 1)
        assert group.handles[1].push_sync(grads[1], 0, 0, None, 0, 1).result(5)[1] == 1
        wait_until(lambda: shards[0].meter.pushes == 1, 30, "replica 1's push on shard 0", every=0.01)
        assert group.steps() == [0, 1]
        assert group.level([0], wait_s=1.0) == [1, 1]
        assert waiting.result(5)[1] == 1
        # replica 1's gradient alone (mean of 1), where replica 0's never came
        params, _ = group.handles[0].get_params().result(5)
        assert torch.allclose(params, torch.full_like(params, -0.1))


def test_level_reports_a_step_no_other_replica_can_complete(inproc_client):
    """A lone replica lost between its pushes to two shards: nothing can complete shard 0's step
    (no gradient of it is in), so ``level`` returns the two steps after its wait (the recovery then
    restarts every shard from the newest checkpoint) and applies nothing."""
    spec = dtrain.loads(SPEC, base_dir=".")
    with group_of(inproc_client, spec) as (group, shards):
        grads = [torch.ones(s.numel) for s in group.plan.shards]
        assert group.handles[1].push_sync(grads[1], 0, 0, None, 0, 1).result(5)[1] == 1
        t0 = time.monotonic()
        assert group.level([0], wait_s=0.5) == [0, 1]
        assert time.monotonic() - t0 >= 0.5
        params, _ = group.handles[0].get_params().result(5)
        assert not params.any()


def checkpoint_for(spec: dtrain.PipelineSpec, states: list[dict]) -> Checkpoint:
    plan = dtrain.compile(spec)
    return Checkpoint(10, Path("ckpt-00000010.pt"), {
        "step": 10, "shards": states, "spec": spec.model_dump(mode="json"), "layout": checkpoint_layout(spec, plan)})


def test_a_restore_refuses_other_variables_and_another_optimizer(inproc_client):
    spec = dtrain.loads(SPEC, base_dir=".")
    with group_of(inproc_client, spec) as (group, _):
        states = [{"params": torch.zeros(s.numel), "step": 10, "optimizer_state": {}} for s in group.plan.shards]
        wider = dtrain.loads(SPEC.replace("out: 3", "out: 5"), base_dir=".")
        with pytest.raises(RunError, match=r"other variables than the model .*0.weight is \[5, 4\] there and \[3, 4\]"):
            group.restore(checkpoint_for(wider, states))
        adam = dtrain.loads(SPEC.replace("{name: sgd, lr: 0.1}", "{name: adam, lr: 0.1}"), base_dir=".")
        with pytest.raises(RunError, match="written with optimizer 'adam', the pipeline has 'sgd'"):
            group.restore(checkpoint_for(adam, states))
        group.restore(checkpoint_for(spec, states))  # the same model: fine (a new lr would be too)
        assert [h.current_step().result(5) for h in group.handles] == [10, 10]


def _accept_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dtrain-ps") and t.name.endswith("-accept")}


def _refused(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_shards_stop_and_free_their_data_plane_when_the_chief_stops_renewing(inproc_client):
    """Review M7: a dead chief's shards must not train on and hold their listeners forever. While
    the group renews, a 1.5 s lease never lapses; once renewal stops (as when the chief is
    killed), every shard stops within the lease (replicas read the stop flag and the error) and
    its listener and accept thread are gone."""
    from dtrain.deploy.cluster import connect

    spec = dtrain.loads(SPEC.replace("mode: sync", "mode: async"), base_dir=".")
    lease = 1.5
    before = _accept_threads()
    with connect(spec, client=inproc_client) as conn, conn.client.as_current():
        plan = dtrain.compile(spec)
        group = ShardGroup(conn, spec, plan, token=f"lease{time.monotonic_ns()}", lease_s=lease)
        try:
            group.create([torch.zeros(s.numel) for s in plan.shards])
            endpoints = group.data_plane["endpoints"]
            mine = _accept_threads() - before
            assert len(endpoints) == 2 and len(mine) == 2
            time.sleep(2 * lease)  # renewed every lease / 4: alive and serving
            assert all(not call_stats(h)["stop"] for h in group.handles)
            assert not any(_refused(h, p) for h, p in endpoints)
            import socket

            from dtrain.dataplane.protocol import MAGIC

            waiting = socket.create_connection(endpoints[0], timeout=5)  # mid-handshake: served by a thread
            assert len(waiting.recv(len(MAGIC) + 16, socket.MSG_WAITALL)) == len(MAGIC) + 16
            group.stop_renewing()
            t0 = time.monotonic()
            # Within the 1.5 s lease, give or take a loaded machine's thread wake-ups (the default
            # lease, max(60 s, 4 x worker_ttl_s), would be far past this bound).
            deadline = t0 + lease + 15.0
            while time.monotonic() < deadline and not all(call_stats(h)["stop"] for h in group.handles):
                time.sleep(0.1)
            stats = [call_stats(h) for h in group.handles]
            assert all(s["stop"] for s in stats) and "lease" in stats[0]["error"], stats
            assert time.monotonic() - t0 < lease + 15.0
            assert all(_refused(h, p) for h, p in endpoints)
            assert waiting.recv(1) == b""  # its connection closed too
            waiting.close()
            for t in mine:
                t.join(timeout=2)
            assert not any(t.is_alive() for t in mine)
            _, _, stop, _ = group.handles[0].pull(0).result(timeout=5)
            assert stop  # a replica's next reply tells it to stop
            with pytest.raises(Exception, match="lease"):
                group.handles[1].renew().result(timeout=5)
        finally:
            group.stop_renewing()
            inproc_client.cancel(group.futures, force=True)


def call_stats(handle) -> dict:
    return handle.stats().result(timeout=5)
