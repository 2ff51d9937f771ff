"""Network faults across the lab, as a cluster sees them (docs/lab.md, "Faults"): a degraded link
(default run), and a worker host or a ps host cut off the network mid-run, detected, and
recovered from once its link is back (``DTRAIN_LAB_FULL=1``). The `dtrain worker` processes run under a stand-in process manager that
starts a task's `dtrain worker` again when it exits, as docs/deployment.md asks of a deployment."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from lab import Lab
from lab.cluster import WORKER_TTL, LabCluster, host_names
from lab.traffic import LinkSampler

from dtrain.chief import checkpoint as ckpt_io

pytestmark = pytest.mark.lab

TASKS = [("ps", 0), ("worker", 0), ("worker", 1)]
TTL_S = float(WORKER_TTL.rstrip("s"))


def _spec(steps: int, checkpoint_every: int | None = None) -> dict:
    spec = {"name": "lab-fault", "cluster": {"jobs": {"ps": 1, "worker": 2}},
            "model": {"input_shape": [64], "layers": [{"type": "linear", "out": 128}, {"type": "relu"},
                                                      {"type": "linear", "out": 10}], "loss": "cross_entropy"},
            "data": {"source": "synthetic", "num_samples": 1024, "num_classes": 10, "batch_size": 32},
            "optimizer": {"name": "sgd", "lr": 0.01},
            "training": {"mode": "async", "steps": steps, "seed": 0},
            "summary": {"every_steps": 50, "tensorboard": False}}
    if checkpoint_every:
        spec["checkpoint"] = {"every_steps": checkpoint_every}
    return spec


class _Watch:
    """The run's progress as the chief writes it, and a process manager for the workers."""

    def __init__(self, cluster: LabCluster, run_dir: Path):
        self.cluster, self.run_dir = cluster, run_dir
        self.restarts: list[str] = []

    def step(self) -> int:
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            return int(json.loads(lines[-1])["step"]) if lines else 0
        except (OSError, ValueError, KeyError):
            return 0

    def tend(self) -> None:
        """Start a task's `dtrain worker` again if it exited (a process manager's restart)."""
        for job, i in TASKS:
            if self.cluster.procs[f"{job}-{i}"].poll() is not None:
                self.restarts.append(f"{job}-{i}")
                self.cluster.start_worker(job, i)

    def until(self, what, timeout: float, proc) -> float:
        deadline = time.monotonic() + timeout
        while not what():
            assert proc.poll() is None or what(), f"the run ended early:\n{self.cluster.log('run')}"
            assert time.monotonic() < deadline, f"timed out:\n{self.cluster.log('run')}"
            self.tend()
            time.sleep(0.2)
        return time.time()


def _finish(watch: _Watch, proc, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the run did not finish:\n{watch.cluster.log('run')}"
        watch.tend()
        time.sleep(0.5)
    assert proc.returncode == 0, watch.cluster.log("run")
    return json.loads((watch.run_dir / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_a_degraded_worker_link_makes_that_replica_the_straggler_not_a_failure(lab_cluster, tmp_path):
    """Async, worker1's link at 20 Mbit/s (both directions) and the others at 1 Gbit/s: its
    replica steps far less often and the run's diagnosis names it, and only it, a straggler; the
    other replica is not held back, and nothing is lost or recovered."""
    lab, cluster = lab_cluster
    steps = 3000
    lab.set_rate("worker1", "20mbit")
    try:
        rc, summary = cluster.run_to_end(_spec(steps), tmp_path / "run", timeout=180, name="run-degraded")
    finally:
        lab.set_rate("worker1", lab.rate)
    assert rc == 0, cluster.log("run-degraded")
    assert summary["status"] == "completed" and summary["global_step"] == steps and summary["recovery_log"] == []
    stragglers = [f for f in summary["diagnosis"] if f.startswith("straggler")]
    assert len(stragglers) == 1 and "(/job:worker/task:1)" in stragglers[0], (summary["diagnosis"],
                                                                               summary["replicas_stats"])
    done = {i: r["steps"] for i, r in summary["replicas_stats"].items()}
    assert done["1"] < 0.5 * done["0"], done


@pytest.mark.lab_full
@pytest.mark.timeout(420)
def test_a_partitioned_worker_host_is_dropped_after_worker_ttl_while_async_training_goes_on(tmp_path):
    """Async: the other replica keeps training while worker1 is cut off; the scheduler drops
    worker-1 once worker-ttl passes without a heartbeat, the chief logs the task lost (no ps
    restore: a replica holds no state), and when the link is back worker-1 serves the task again
    and the run completes every step."""
    steps = 20000
    with Lab(host_names(TASKS), rate="1gbit") as lab, LabCluster(lab, TASKS, tmp_path / "c") as cluster:
        run_dir = tmp_path / "run"
        proc = cluster.run(_spec(steps), run_dir)
        watch = _Watch(cluster, run_dir)
        watch.until(lambda: watch.step() >= 300, 120, proc)
        lab.partition("worker1")
        t_cut, step_cut = time.time(), watch.step()
        watch.until(lambda: "lost /job:worker/task:1" in cluster.log("run"), 150, proc)
        lab.heal("worker1")
        summary = _finish(watch, proc)
        back = cluster.wait_for({"worker-1"}, 60)
        assert back["worker-1"]["address"].startswith(f"tcp://{lab['worker1'].address}:"), back
    assert summary["status"] == "completed" and summary["global_step"] == steps, summary
    (rec,) = summary["recovery_log"]
    assert rec["lost"] == ["/job:worker/task:1"] and rec["restored_step"] is None, rec
    assert TTL_S <= rec["time"] - t_cut <= 120, (rec, t_cut)  # no earlier than the scheduler can know
    assert rec["step"] >= step_cut + 500, (rec, step_cut)  # worker0 trained on meanwhile
    assert summary["data_plane"]["shared_memory_connections"] == 0
    assert lab.leftovers() == []


@pytest.mark.lab_full
@pytest.mark.timeout(420)
def test_a_partitioned_ps_host_stops_the_run_until_it_is_back_then_it_resumes_from_the_checkpoint(tmp_path):
    """Every replica needs ps0: training stops, the chief's poll of the shard's progress times
    out (a transient error), and the session restarts as TensorFlow's MonitoredTrainingSession does: it waits
    for ps-0 (cluster.wait_s), restores the shard from the newest checkpoint and trains on."""
    steps, every = 12000, 1000
    with Lab(host_names(TASKS), rate="1gbit") as lab, LabCluster(lab, TASKS, tmp_path / "c") as cluster:
        run_dir = tmp_path / "run"
        proc = cluster.run(_spec(steps, every), run_dir)
        watch = _Watch(cluster, run_dir)
        watch.until(lambda: watch.step() >= 1500, 120, proc)
        lab.partition("ps0")
        t_cut, step_cut = time.time(), watch.step()
        time.sleep(3)
        stalled = watch.step()
        watch.until(lambda: "recovering" in cluster.log("run"), 150, proc)
        time.sleep(2)
        lab.heal("ps0")
        summary = _finish(watch, proc)
    assert stalled <= step_cut + 100, (step_cut, stalled)  # no replica trains without its ps
    assert summary["status"] == "completed" and summary["global_step"] == steps, summary
    (rec,) = summary["recovery_log"]
    # Seen first as the poll's timeout (a transient error), or as ps-0 dropped by the scheduler
    # at worker-ttl, whichever comes first: both restart every shard from the checkpoint.
    assert (rec["lost"] == [] and "timed out" in rec["error"]) or rec["lost"] == ["/job:ps/task:0"], rec
    assert every <= rec["restored_step"] <= step_cut, (rec, step_cut)  # the newest checkpoint before the cut
    assert rec["time"] - t_cut <= 60, (rec, t_cut)
    assert lab.leftovers() == []


def _ps_step(cluster: LabCluster) -> int | None:
    """The global step of the run's ps shard 0, asked of its actor from the scheduler's host (the
    chief's may be cut off): ``get_params`` reads it without changing anything (None: no shard)."""
    out = cluster.ask(
        "from distributed.actor import Actor\n"
        "from dtrain.worker.tasks import WorkerShard\n"
        "def shards(dask_scheduler):\n"
        "    return [(k, [w.address for w in ts.who_has or ()]) for k, ts in dask_scheduler.tasks.items()\n"
        "            if str(k).startswith('dtrain-ps-0-')]\n"
        "out = None\n"
        "with c.as_current():\n"
        "    for key, where in c.run_on_scheduler(shards):\n"
        "        if where:\n"
        "            out = Actor(WorkerShard, where[0], key).get_params().result(timeout=20)[1]\n",
        host="scheduler", timeout=90)
    return None if out is None else int(out)


@pytest.mark.lab_full
@pytest.mark.timeout(420)
def test_a_partitioned_chief_host_lets_the_lease_stop_the_shards_and_nothing_trains_on_alone(tmp_path):
    """The chief's host (client) cut off the cluster mid-run: the ps and the replicas still reach
    each other and train on until a shard waits for the chief: at the latest when the shards' lease
    (``cluster.lease_s``) runs out without a renewal, and each shard stops its replicas and closes
    its data plane; earlier where a checkpoint's hold was under way (the shards pause at the held
    step for a release that never comes). The ps's step does not move after the lease ran out, no
    replica reports a step then, nothing but heartbeats crosses ps0's link, no task is left
    running, the ps host listens on nothing but its Dask worker's ports again, and once the link is
    back ``--resume`` continues from the newest checkpoint (nothing lost)."""
    lease_s, every = 8.0, 500
    with Lab(host_names(TASKS), rate="1gbit") as lab, LabCluster(lab, TASKS, tmp_path / "c") as cluster:
        run_dir, stop_file = tmp_path / "run", tmp_path / "stop"
        spec = _spec(10_000_000, every)
        spec["cluster"]["lease_s"] = lease_s
        spec["hooks"] = [{"type": "benchmarks.lab.hooks:StopFileHook", "args": {"path": str(stop_file)}}]
        ports_idle = lab["ps0"].listening()  # the Dask worker's and its nanny's
        proc = cluster.run(spec, run_dir)
        watch = _Watch(cluster, run_dir)
        watch.until(lambda: watch.step() >= 2 * every + 200, 120, proc)
        data_plane = lab["ps0"].listening() - ports_idle
        assert data_plane, "the ps serves its data plane on a port of its own"
        with LinkSampler(lab, period=0.1) as links:
            time.sleep(2)
            lab.partition("client")
            t_cut, step_cut = time.time(), watch.step()
            t_expired = t_cut + lease_s  # the last renewal was before the cut: the lease ran out by then
            time.sleep(lease_s + 2)
            ps_steps = [_ps_step(cluster)]
            time.sleep(4)
            ps_steps.append(_ps_step(cluster))
            t_end = time.time()
        reports = [(t, m) for t, m in cluster.events("dtrain-replica", host="scheduler")
                   if isinstance(m, dict) and str(m.get("run", "")).startswith("lab-fault")]
        processing = cluster.ask("out = {k: list(v) for k, v in c.processing().items()}", host="scheduler")
        ports_after = lab["ps0"].listening()
        ps_log = cluster.log("ps-0", 20000)
        # The chief, cut off from the scheduler and every worker, gives up (its client's reconnection
        # attempts, then "lost the connection to the scheduler").
        rc = proc.wait(150)
        lab.heal("client")
        chief = json.loads((run_dir / "summary.json").read_text())

        # What crossed ps0's link (gradients in): training before the cut, on until the lease ran
        # out, and nothing but the Dask worker's heartbeats after it.
        def rate(ta, tb):
            between = links.between(ta, tb)
            assert between is not None, (ta, tb)
            return between["ps0"]["in"] / (tb - ta)

        before, during, after = rate(t_cut - 2, t_cut), rate(t_cut + 0.5, t_expired - 1), rate(t_expired + 2, t_end - 1)
        # The replicas' own reports (each attempt's local steps, about every second): the step at
        # which training stopped (async, none dropped: a push is a step) and when each last moved.
        steps: dict[tuple[int, int], int] = {}
        moved: dict[tuple[int, int], float] = {}
        for t, m in reports:
            key = (m["replica"], m["attempt"])
            if m["steps"] > steps.get(key, -1):
                steps[key], moved[key] = m["steps"], t
        figures = {"step_cut": step_cut, "ps steps after the lease": ps_steps, "bytes/s into ps0 before the cut": before,
                   "until the lease ran out": during, "after": after,
                   "last reported step after the cut (s)": {k: round(t - t_cut, 2) for k, t in moved.items()}}
        print(figures)
        stopped_step = ps_steps[0]
        assert ps_steps[1] == stopped_step >= step_cut, figures  # where training stopped, and stayed
        assert {i for i, _ in steps} == {0, 1}, reports[-6:]
        assert max(moved.values()) <= t_expired + 2.0, figures  # no replica stepped after the lease ran out
        assert before > 1e6 and after < 0.01 * before, figures  # and nothing but heartbeats into ps0
        assert f"no word from the chief for {lease_s:g} s (its lease)" in ps_log, ps_log[-3000:]
        assert all(not keys for keys in processing.values()), processing  # no replica task runs on
        assert ports_after == ports_idle, (ports_idle, data_plane, ports_after)  # the data plane closed
        assert rc != 0 and chief["status"] == "failed", (rc, chief.get("status"), cluster.log("run"))

        # Nothing lost: the newest checkpoint (at most where training stopped: the held step's own
        # when the failing chief could commit it from the parts on the shared file system) resumes,
        # and training goes on.
        newest = ckpt_io.latest(run_dir).step
        assert every <= newest <= stopped_step, (newest, figures)
        seen = len((run_dir / "metrics.jsonl").read_text().splitlines())
        proc = cluster.run(spec, run_dir, name="resume", resume=True)
        watch = _Watch(cluster, run_dir)

        def resumed() -> int:  # the resumed run's newest record's step (0 before its first)
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()[seen:]
            return max([int(json.loads(x).get("step", 0)) for x in lines if x.strip()] or [0])

        watch.until(lambda: resumed() >= newest + 300, 120, proc)
        stop_file.touch()
        summary = _finish(watch, proc)
    assert summary["status"] == "completed" and summary["start_step"] == newest, summary
    assert summary["global_step"] >= newest + 300 and summary["recovery_log"] == [], summary
    assert lab.leftovers() == []
