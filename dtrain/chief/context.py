"""What one run of the chief is and where it stands, declared in one place.

:class:`RunContext` is what does not change during a run: the spec, the plan compiled from it
(once per run), the connection to the cluster (its client, the worker address of each task),
the run directory, the run's token and id, a sharded dataset's input, the caller's progress
callback. It is frozen: no role rebinds it.

:class:`RunState` is what the run has reached: the plan on the cluster's workers now (the
compiled plan, bound to them again after a recovery or an elastic join or leave: the workers
changed, not the plan), the steps and samples polled from the ps, the summary records, each
replica's place in its data, the replicas retired, why training stopped, the evaluations, the
replicas' final stats, the secret the pipeline stages' links share. Every
field is declared here; the session owns it and rebinds its fields, and each role
(``chief/replicas.py``, ``saver.py``, ``recovery.py``, ...) receives it by name to read it (the
few containers a role keeps up to date are named in the field's comment).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from distributed import Client

from dtrain.deploy.cluster import Connection
from dtrain.plan.compiler import Plan, on_workers, with_data
from dtrain.spec.pipeline import PipelineSpec

from .inputs import DataInput, with_stats


@dataclass(frozen=True)
class RunContext:
    """One run's fixed context (see the module docstring)."""

    spec: PipelineSpec
    conn: Connection
    run_dir: Path
    token: str  # one per start or resume
    resume: bool = False
    data_input: DataInput | None = None  # a sharded dataset (files or a Dask collection): chief/inputs.py
    progress: Callable[[dict[str, Any]], None] | None = None
    # The run's plan, compiled once, before any cluster started (chief/preflight.py), with a sharded
    # dataset's assignment and statistics; on no workers yet (place_plan puts it on them).
    compiled: Plan | None = None

    @property
    def client(self) -> Client:
        return self.conn.client

    @property
    def run_id(self) -> str:
        """This run's id (``<name>-<token>``, one per start or resume): the scheduler's page, its
        Prometheus series and the replicas' reports tell runs apart by it, never by name alone."""
        return f"{self.spec.name}-{self.token}"

    def place_plan(self) -> Plan:
        """The run's compiled plan on the cluster's workers now (``dtrain.plan.compiler.on_workers``:
        nothing is compiled again; the session calls it at start and whenever the workers change)."""
        assert self.compiled is not None, "a run context without its compiled plan"
        return on_workers(self.compiled, self.spec, self.conn.workers(), keep=self.conn.tasks)


def run_plan(plan: Plan, data: DataInput | None) -> Plan:
    """A compiled plan with a sharded dataset's assignment and statistics (``data``: what the run
    trains on, its shards known before the cluster starts for files, on it for a Dask collection)."""
    return plan if data is None else with_stats(with_data(plan, data.manifests), data)


@dataclass
class RunState:
    """Where one run stands (see the module docstring)."""

    plan: Plan
    global_step: int = 0  # the ps's step at the chief's last poll
    start_step: int = 0  # the step this run (start or resume) began at
    samples: int = 0
    dropped_stale: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)  # the ps's summary records, in order
    local_steps: dict[int, int] = field(default_factory=dict)  # each replica's place in its data
    retired: set[int] = field(default_factory=set)  # at the end of their data (the replica set updates it)
    stop_reason: str | None = None  # why training ended before training.steps (a hook, nan_guard)
    stop_requested: str | None = None  # a hook's RunView.request_stop(), acted on at the next step observed
    eval_history: list[dict[str, Any]] = field(default_factory=list)  # appended by the evaluator
    replica_stats: list[dict[str, Any]] = field(default_factory=list)  # each replica's result, at the end
    init_buffers: list[torch.Tensor] = field(default_factory=list)  # the initial parameters, per shard
    t_train: float | None = None  # when training started (time.time())
    train_s: float | None = None  # how long it took
    begun: bool = False  # the hooks' begin() was called
    summary_written: bool = False
    # One per run, like the ps data plane's: the pipeline stages' links authenticate with it.
    stage_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
