"""Recovery on an in-process cluster of its own, where a task is lost by closing its real Dask
worker (the scheduler sees it leave, its actor and task are gone) and brought back by starting a
new worker of the same name: the recovery budget running out, a lost worker in async mode, and
the on_task_lost hook. (Killed processes: test_recovery.py, test_chaos.py.)"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import dask
import pytest
from distributed import Client, Scheduler, SpecCluster, Worker

import dtrain
from dtrain.deploy.cluster import HOUSEKEEPING
from dtrain.errors import RunError
from tests.helpers.hooks import read_calls
from tests.helpers.pipelines import pipeline_yaml
from tests.helpers.waiting import wait_until


def recovery_pipeline(mode: str, steps: int, recoveries: int, calls, workers: int = 2) -> str:
    return pipeline_yaml(
        "inproc-recovery", jobs={"ps": 2, "worker": workers}, cluster={"wait_s": 30},
        training={"mode": mode, "steps": steps, "max_recoveries": recoveries, "call_timeout_s": 20,
                  "barrier_timeout_s": 20},
        checkpoint={"every_steps": 50},
        hooks=[{"type": "tests.helpers.hooks:RecordingHook", "args": {"path": str(calls)}}])


@pytest.fixture
def cluster():
    workers = {f"{job}-{i}": {"cls": Worker, "options": {
        "name": f"{job}-{i}", "nthreads": 2, "resources": {job: 1}, "host": "127.0.0.1", "dashboard": False,
        "memory_limit": "2GiB"}} for job in ("ps", "worker") for i in range(2)}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False,
                                               "dashboard_address": None}}
    with dask.config.set({"distributed.scheduler.work-stealing": False, "distributed.admin.tick.limit": "60s", **HOUSEKEEPING}):
        cluster = SpecCluster(workers=workers, scheduler=scheduler, name="recovery-tests")
        client = Client(cluster, direct_to_workers=True, set_as_default=False)
        yield cluster, client
        client.close()
        cluster.close()


def lose(cluster: SpecCluster, name: str, come_back: bool) -> None:
    """Close worker ``name`` (its task is lost), and with ``come_back`` start a new one of that name.
    A closed worker's actors live on in this process, their data-plane listeners open until a lease
    that needs the closed worker's loop: closed here, as a dead process's would be. So are the
    connection threads still waiting inside a closed shard (a sync push at its barrier): the shard
    is stopped once its data plane is closed (no replica reads that stop: their sockets are cut)."""
    worker = cluster.workers.pop(name)
    actors = list(worker.state.actors.values())
    cluster.sync(worker.close)
    for actor in actors:
        if getattr(actor, "data_plane", None) is not None:
            actor.data_plane.close()
            cluster.sync(actor.request_stop)
    if come_back:
        time.sleep(0.5)
        cluster.sync(cluster._correct_state)  # the spec still lists it: a new worker is started


def run_in_thread(spec, client, run_dir: Path) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target() -> None:
        try:
            out["result"] = dtrain.run(spec, client=client, run_dir=run_dir)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def wait_for_step(run_dir: Path, step: int, thread: threading.Thread, timeout: float = 120) -> None:
    def reached() -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and any(json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines() if x)

    def alive() -> None:
        assert thread.is_alive()

    wait_until(reached, timeout, f"step {step}", check=alive)


@pytest.mark.slow
def test_running_out_of_recoveries_fails_the_run_and_tells_the_hooks(cluster, tmp_path):
    cluster, client = cluster
    calls = tmp_path / "calls.jsonl"
    spec = dtrain.loads(recovery_pipeline("sync", 100000, 0, calls), base_dir=".")
    thread, out = run_in_thread(spec, client, tmp_path / "run")
    wait_for_step(tmp_path / "run", 30, thread)
    lose(cluster, "ps-1", come_back=False)
    thread.join(120)
    assert isinstance(out.get("error"), RunError), out
    assert "recovery attempts used up (training.max_recoveries: 0)" in str(out["error"])
    assert "/job:ps/task:1" in str(out["error"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "recovery attempts used up" in summary["error"]
    assert ("on_task_lost", "/job:ps/task:1") in read_calls(calls)


def test_async_goes_on_after_a_lost_worker_and_its_replica_restarts(cluster, tmp_path):
    cluster, client = cluster
    calls = tmp_path / "calls.jsonl"
    spec = dtrain.loads(recovery_pipeline("async", 600, 2, calls), base_dir=".")
    thread, out = run_in_thread(spec, client, tmp_path / "run")
    wait_for_step(tmp_path / "run", 100, thread)
    lose(cluster, "worker-1", come_back=True)
    thread.join(180)
    assert "error" not in out, out.get("error")
    s = out["result"].summary
    assert s["status"] == "completed" and s["global_step"] >= 600 and s["recoveries"] == 1
    rec = s["recovery_log"][0]
    assert rec["lost"] == ["/job:worker/task:1"] and rec["restored_step"] is None and rec["step"] >= 100
    assert ("on_task_lost", "/job:worker/task:1") in read_calls(calls)
    # the replacement replica ran on the new worker-1 and contributed steps after the loss
    assert {st["worker"] for st in out["result"].replica_stats} == {"worker-0", "worker-1"}
    assert s["eval"]["accuracy"] >= 0.9


@pytest.mark.slow
def test_a_task_lost_again_during_a_recovery_is_another_recovery(cluster, tmp_path, monkeypatch):
    """ps-1 is lost; while the chief recreates the shards, ps-1 is lost once more (its restarted
    worker closes as the actors are created, and the creation runs against it, as Dask has it):
    the chief recovers again, within max_recoveries (a creation that failed part-way once made
    the chief's loss check raise instead)."""
    from dtrain.chief.ps_shards import ShardGroup

    cluster, client = cluster
    calls = tmp_path / "calls.jsonl"
    spec = dtrain.loads(recovery_pipeline("sync", 300, 3, calls), base_dir=".")
    real_create = ShardGroup.create
    creates = []

    def create(self, init):
        creates.append(self.generation)
        if len(creates) == 2:  # the first recovery's: its ps-1 goes too, for real, as it starts
            lose(cluster, "ps-1", come_back=True)  # (a spy: the creation that follows is the real one)
        return real_create(self, init)

    monkeypatch.setattr(ShardGroup, "create", create)
    thread, out = run_in_thread(spec, client, tmp_path / "run")
    wait_for_step(tmp_path / "run", 60, thread)
    lose(cluster, "ps-1", come_back=True)
    thread.join(180)
    assert "error" not in out, out.get("error")
    s = out["result"].summary
    assert s["status"] == "completed" and s["global_step"] == 300
    assert s["recoveries"] == 2 and [r["lost"] for r in s["recovery_log"]] == [["/job:ps/task:1"]] * 2
    assert [v for e, v in read_calls(calls) if e == "on_task_lost"] == ["/job:ps/task:1"] * 2


def test_a_lone_sync_replica_lost_between_two_shards_restarts_from_the_checkpoint(cluster, tmp_path):
    """Sync, one replica, two ps shards: the replica's worker is lost and one shard is a step ahead
    of the other (a hook pushes that shard's half of the step, as a replica killed between its two
    pushes does). No other replica's gradients can complete the lagging shard's step, so the
    recovery restarts both shards from the newest checkpoint (``unlevel_steps``), within the one
    recovery, and the run completes; resubmitting the replica onto shards of two steps would not."""
    cluster, client = cluster
    calls = tmp_path / "calls.jsonl"
    text = recovery_pipeline("sync", 300, 2, calls, workers=1)
    text = text.replace('hooks: [', 'hooks: [{type: "tests.helpers.hooks:HalfPushOnLoss"}, ')
    spec = dtrain.loads(text, base_dir=".")
    thread, out = run_in_thread(spec, client, tmp_path / "run")
    wait_for_step(tmp_path / "run", 60, thread)
    lose(cluster, "worker-0", come_back=True)
    thread.join(180)
    assert "error" not in out, out.get("error")
    s = out["result"].summary
    assert s["status"] == "completed" and s["global_step"] == 300 and s["recoveries"] == 1
    rec = s["recovery_log"][0]
    assert rec["lost"] == ["/job:worker/task:0"]
    steps = rec["unlevel_steps"]
    assert len(steps) == 2 and steps[0] != steps[1], rec
    assert rec["restored_step"] >= 50 and rec["restored_step"] % 50 == 0, rec
    assert s["eval"]["accuracy"] >= 0.9


@pytest.mark.slow
def test_calls_to_every_shard_survive_a_lost_one(cluster):
    """A lost ps's actor handle refuses every method at once (RuntimeError "Worker holding Actor
    was lost", raised where the call is made, not by its future): the telemetry's read of every
    shard and the fencing of replicas, which start a call on each shard before collecting any,
    leave the lost one out instead of raising out of the chief's loop before recovery runs."""
    import torch

    from dtrain.chief.ps_shards import ShardGroup
    from dtrain.deploy.cluster import connect

    cluster, client = cluster
    spec = dtrain.loads(recovery_pipeline("sync", 100, 1, "unused"), base_dir=".")
    with connect(spec, client=client) as conn, conn.client.as_current():
        plan = dtrain.compile(spec)
        group = ShardGroup(conn, spec, plan, token=f"lost{time.monotonic_ns()}")
        try:
            group.create([torch.zeros(s.numel) for s in plan.shards])
            assert sorted(group.loads()) == [0, 1]
            lose(cluster, "ps-1", come_back=False)
            wait_until(lambda: group.futures[1].status == "error", 10, "ps-1's actor lost")
            with pytest.raises(RuntimeError, match="Worker holding Actor was lost"):
                group.handles[1].load()
            assert sorted(group.loads()) == [0]
            group.set_owners({0: 2})  # a warning for the lost shard, no exception
            assert group.handles[0].stats().result(timeout=5)["step"] == 0  # the live shard still answers
        finally:
            group.stop_renewing()
            group.close_data_plane()  # as the session does at the end (the lost shard's is closed by lose)
            client.cancel(group.futures, force=True)


def test_a_worker_restarted_while_the_chief_waits_for_another_is_lost_too(cluster, tmp_path, monkeypatch):
    """worker-1 is lost; while the recovery waits for its worker, worker-0 is restarted too (at a
    new address, as a nanny restarts a worker that missed its heartbeats under load). The recovery
    points every task at its worker now, so no later check can see worker-0's loss: its replica
    is resubmitted with worker-1's (it used to wait, pinned to the old address, for ever, and the
    run with it: the lab's 16-replica scaling benchmark hung so)."""
    from dtrain.chief import recovery

    cluster, client = cluster
    calls = tmp_path / "calls.jsonl"
    spec = dtrain.loads(recovery_pipeline("async", 600, 2, calls), base_dir=".")
    real_wait = recovery.wait_for_tasks
    waits = []

    def wait_for_tasks(conn, spec, timeout, **kwargs):
        waits.append(dict(conn.tasks))
        if len(waits) == 1:
            lose(cluster, "worker-0", come_back=True)
        return real_wait(conn, spec, timeout, **kwargs)

    monkeypatch.setattr(recovery, "wait_for_tasks", wait_for_tasks)
    thread, out = run_in_thread(spec, client, tmp_path / "run")
    wait_for_step(tmp_path / "run", 100, thread)
    lose(cluster, "worker-1", come_back=True)
    thread.join(120)
    assert not thread.is_alive(), "the run waits for a replica pinned to a worker that is gone"
    assert "error" not in out, out.get("error")
    s = out["result"].summary
    assert s["status"] == "completed" and s["global_step"] >= 600 and s["recoveries"] == 1, s
    assert s["recovery_log"][0]["lost"] == ["/job:worker/task:1", "/job:worker/task:0"], s["recovery_log"]
    assert [v for e, v in read_calls(calls) if e == "on_task_lost"] == ["/job:worker/task:1", "/job:worker/task:0"]
