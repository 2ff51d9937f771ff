"""Automatic assignment of tasks to a cluster's workers as they come (plan/assign.py): pure, no cluster."""

from __future__ import annotations

import copy

import pytest
import yaml

import dtrain
from dtrain.plan.assign import assign_workers, task_host
from tests.helpers.paths import PIPELINES

PS0, PS1, W0, W1 = "/job:ps/task:0", "/job:ps/task:1", "/job:worker/task:0", "/job:worker/task:1"


def _spec(name: str = "digits_async", **cluster) -> dtrain.PipelineSpec:
    data = copy.deepcopy(yaml.safe_load((PIPELINES / f"{name}.yaml").read_text()))
    data["cluster"] = {**data.get("cluster", {}), **cluster}
    return dtrain.PipelineSpec.model_validate(data, context={"base_dir": str(PIPELINES)})


def _workers(*addresses: str, names: list | None = None) -> dict[str, dict]:
    """As LocalCluster names them: 0, 1, 2, ... and no resources."""
    names = names if names is not None else list(range(len(addresses)))
    return {a: {"name": n, "resources": {}} for a, n in zip(addresses, names, strict=True)}


@pytest.fixture(scope="module")
def digits() -> dtrain.PipelineSpec:
    return _spec()  # 2 ps tasks, 2 worker tasks


def test_local_cluster_gets_ps_first_then_one_replica_per_worker(digits):
    workers = _workers(*(f"tcp://127.0.0.1:{5000 + i}" for i in range(4)))
    a = assign_workers(digits, dict(reversed(list(workers.items()))))  # whatever the scheduler's order
    assert a.mode == "auto" and a.shared == () and a.missing == []
    assert a.addresses == {PS0: "tcp://127.0.0.1:5000", PS1: "tcp://127.0.0.1:5001",
                           W0: "tcp://127.0.0.1:5002", W1: "tcp://127.0.0.1:5003"}


def test_names_sort_naturally(digits):
    workers = _workers(*(f"tcp://h:{i}" for i in range(11)), names=list(range(11)))
    a = assign_workers(digits, workers)
    assert [a.addresses[k] for k in (PS0, PS1, W0, W1)] == ["tcp://h:0", "tcp://h:1", "tcp://h:2", "tcp://h:3"]


def test_ps_tasks_spread_over_hosts(digits):
    # Two machines, two workers each: the ps tasks go one per machine, not both on the first.
    workers = _workers("tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "tcp://10.0.0.2:1", "tcp://10.0.0.2:2")
    a = assign_workers(digits, workers)
    assert {task_host(a.addresses[PS0]), task_host(a.addresses[PS1])} == {"10.0.0.1", "10.0.0.2"}
    assert len(set(a.addresses.values())) == 4


def test_fewer_workers_than_tasks_share_a_ps_never_a_replica(digits):
    three = _workers("tcp://h:1", "tcp://h:2", "tcp://h:3")
    a = assign_workers(digits, three)
    assert a.missing == [] and a.shared == (PS1,)
    assert a.addresses[W0] != a.addresses[W1]
    assert a.addresses[PS0] not in (a.addresses[W0], a.addresses[W1])
    assert a.addresses[PS1] in (a.addresses[W0], a.addresses[W1])
    two = assign_workers(digits, _workers("tcp://h:1", "tcp://h:2"))
    assert two.shared == (PS0, PS1) and two.missing == []
    assert two.addresses[W0] != two.addresses[W1]
    assert two.addresses[PS0] != two.addresses[PS1]  # round robin over the replicas' workers
    one = assign_workers(digits, _workers("tcp://h:1"))
    assert one.missing == [W1]  # never two replicas on one worker: the run waits for another


def test_an_earlier_assignment_stays_while_its_worker_lives(digits):
    # Random pod-like names (dask-kubernetes): a newcomer may sort before the workers there are.
    workers = _workers(*(f"tcp://h:{i}" for i in range(4)), names=["pod-c", "pod-d", "pod-e", "pod-f"])
    first = assign_workers(digits, workers)
    # The worker of replica 0 leaves and another joins: only replica 0 moves, the ps shards stay.
    del workers[first.addresses[W0]]
    workers["tcp://h:0099"] = {"name": "pod-b", "resources": {}}
    again = assign_workers(digits, workers, keep={k: v for k, v in first.addresses.items() if v})
    assert {k: again.addresses[k] for k in (PS0, PS1, W1)} == {k: first.addresses[k] for k in (PS0, PS1, W1)}
    assert again.addresses[W0] == "tcp://h:0099"
    # Without the earlier assignment the fresh one would have moved a ps task.
    assert assign_workers(digits, workers).addresses[PS0] == "tcp://h:0099"


def test_named_workers_win_over_auto(digits):
    # One dtrain-named worker present: the named rule applies to every task; the others wait.
    workers = {"tcp://h:1": {"name": "ps-0", "resources": {}}, "tcp://h:2": {"name": 7, "resources": {}},
               "tcp://h:3": {"name": 8, "resources": {}}}
    a = assign_workers(digits, workers)
    assert a.mode == "named" and a.addresses[PS0] == "tcp://h:1"
    assert a.missing == [PS1, W0, W1]


def test_assign_named_never_assigns_automatically():
    spec = _spec(assign="named")
    a = assign_workers(spec, _workers(*(f"tcp://h:{i}" for i in range(4))))
    assert a.mode == "named" and a.missing == [PS0, PS1, W0, W1]


def test_assign_rejects_other_values():
    with pytest.raises(Exception, match="auto"):
        _spec(assign="random")


def test_graph_pipelines_get_a_worker_per_task():
    a = assign_workers(_spec("hello_graph"), _workers("tcp://h:1", "tcp://h:2"))
    assert a.mode == "auto" and a.addresses == {"/job:local/task:0": "tcp://h:1"}


def test_the_plan_says_how_tasks_were_assigned(digits):
    workers = _workers(*(f"tcp://h:{i}" for i in range(3)))
    plan = dtrain.compile(digits, workers)
    assert plan.assignment == "auto" and plan.shared_tasks == (PS1,) and plan.missing_tasks == ()
    text = plan.format()
    assert "workers assigned automatically" in text and f"sharing a replica's worker: {PS1}" in text
    assert plan.to_json()["assignment"] == "auto"
    named = dtrain.compile(digits, {f"tcp://h:{i}": {"name": n} for i, n in enumerate(["ps-0", "ps-1", "worker-0",
                                                                                       "worker-1"])})
    assert named.assignment == "named" and "assigned automatically" not in named.format()
    assert dtrain.compile(digits).assignment == ""  # no cluster: nothing assigned
