"""A ps shard's state, shared by its parts: the parameters, their optimizer, the step, the flags.

``ShardCore`` is the part of ``ParameterShard`` that every other part is given (with the
shard's :class:`~dtrain.ps.waits.ShardWaits`): the flat parameter buffer and its optimizer, the
moving averages, the table parts (:class:`~dtrain.ps.sparse.ShardTables`), the meter, the step's
source (the sync barrier's :class:`~dtrain.ps.replication.SyncAggregator` or the token queue's
:class:`~dtrain.ps.tokens.TokenSync` in sync mode, :class:`~dtrain.ps.replication.AsyncPolicy`
in async mode), the stop and error flags and the checkpoint hold's step (``hold_at``); and the
work every push shares: one update (:meth:`ShardCore.apply`: the optimizer step, then the
step's bookkeeping), a push's report (:meth:`ShardCore.observe`), the refusals (a non-finite
gradient under nan_guard, an id outside its table) and the reply (a snapshot of the parameters
in a ring of preallocated buffers, or in the caller's). Shard 0's summary records are a
:class:`StepRecords` it owns.

Every method here runs under the shard's ``lock`` (the caller holds it; ps/fastpath.py). No
Dask here.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dtrain.observe.meters import ShardMeter

from .averages import make_average
from .optim import make_optimizer
from .replication import AsyncPolicy, StalenessGate, SyncAggregator
from .sparse import Reply, ShardTables, Sparse
from .tokens import TokenSync
from .waits import ShardWaits


def sync_for(config: dict[str, Any], num_replicas: int) -> SyncAggregator | TokenSync:
    """The shard's sync state machine: the token queue under ``sync_tokens``, else the barrier."""
    to_aggregate = config.get("replicas_to_aggregate") or num_replicas
    if config.get("sync_tokens"):
        return TokenSync(to_aggregate, num_replicas, init_tokens=config.get("init_tokens"))
    return SyncAggregator(to_aggregate, num_replicas, fraction=config.get("aggregate_fraction"))


class StepRecords:
    """Shard 0's bookkeeping: the pushes' losses and samples, closed into a record every
    ``summary_every`` global steps (drained by ``ParameterShard.stats``), and each replica's
    last local step."""

    def __init__(self, summary_every: int = 100):
        self.summary_every = summary_every
        self.interval: dict[str, float] = {"loss_sum": 0.0, "loss_n": 0, "samples": 0, "t0": time.time()}
        self.samples_total = 0
        self.records: list[dict[str, Any]] = []
        self.local_steps: dict[int, int] = {}

    def observe(self, replica: int, loss: float | None, samples: int, local_step: int) -> bool:
        """Count one push's report; False (its loss and local step not counted) for a loss that
        is not finite."""
        self.samples_total += samples
        self.interval["samples"] += samples
        if loss is not None:
            if not math.isfinite(loss):
                return False
            self.interval["loss_sum"] += loss
            self.interval["loss_n"] += 1
        self.local_steps[replica] = local_step
        return True

    def due(self, step: int, steps: int) -> bool:
        """Whether global step ``step`` closes a record (every summary_every steps, and the last)."""
        return step % self.summary_every == 0 or step == steps

    def close(self, step: int, dropped_stale: int) -> None:
        """Close the interval into a record at global step ``step``."""
        now = time.time()
        iv = self.interval
        dt = max(now - iv["t0"], 1e-9)
        self.records.append({
            "step": step, "time": now,
            "loss": iv["loss_sum"] / iv["loss_n"] if iv["loss_n"] else None,
            "samples_per_sec": iv["samples"] / dt, "dropped_stale": dropped_stale,
            "samples": self.samples_total,
        })
        self.interval = {"loss_sum": 0.0, "loss_n": 0, "samples": 0, "t0": now}

    def drain(self) -> list[dict[str, Any]]:
        """The records closed since the last call."""
        records, self.records = self.records, []
        return records


class ShardCore:
    """One shard's state and the work every push shares (see the module docstring)."""

    def __init__(self, config: dict[str, Any], init: torch.Tensor, waits: ShardWaits):
        """``config``: the shard's (``ShardGroup`` builds it); ``init``: its initial parameters;
        ``waits``: the shard's, whose ``tcond`` every apply notifies."""
        self.waits = waits
        self.index: int = config["index"]
        self.mode: str = config["mode"]
        self.steps: int = config["steps"]
        self.generation: int = config.get("generation", 0)
        self.holds_global_step: bool = config.get("holds_global_step", self.index == 0)
        self.nan_guard: bool = config.get("nan_guard", False)
        num_replicas = self.num_replicas = config.get("num_replicas", 1)
        # A plain tensor (no autograd) updated by a flat optimizer with torch.optim's semantics.
        self.param = init.detach().to(torch.float32).clone()
        self.optimizer = make_optimizer(self.param.numel(), config["optimizer"])
        self.averages = make_average(config.get("moving_average"), self.param)  # None: no EMA (ps/averages.py)
        # Sparse embedding tables: this task's rows of each, initialised here from the run's seed
        # (never shipped); a push carries (ids, row gradients) and asks for the next batch's rows.
        # A table with its own optimizer config uses it, the others the run's.
        # Parts that agree on their layout and row optimizer share buffers (ps/groups.py).
        # checkpoint.incremental: the tables track their changes (ps/deltas.py).
        self.tables = ShardTables(config.get("tables", ()), config["optimizer"], track=bool(config.get("incremental")),
                                  shard=self.index)
        self.sync = sync_for(config, num_replicas)  # the barrier, or TF's token queue (sync_tokens)
        self.policy = AsyncPolicy(config.get("max_staleness"))
        k = config.get("max_staleness")
        self.gate = StalenessGate(num_replicas, k) if (k is not None and self.holds_global_step) else None
        self.stop = False
        self.error: str | None = None
        # Checkpoint snapshots: applies pause once the step reaches hold_at, until released
        # (ps/control.py); checkpoint.every_steps pauses by itself at every multiple (after_apply).
        self.hold_at: int | None = None
        self.checkpoint_every: int | None = config.get("checkpoint_every")
        self.records = StepRecords(config.get("summary_every", 100))
        self.last_apply_time = 0.0
        # Telemetry (observe.telemetry): pushes, applies, busy seconds, bytes, staleness.
        self.meter: ShardMeter | None = ShardMeter(self.param.numel() * 4) if config.get("telemetry", True) else None
        # Reply snapshots for the actor path, allocated on first use (the socket data plane passes
        # its own ``out`` buffer: a shared-memory slot or a per-connection buffer).
        self._ring_size = 2 * num_replicas + 4
        self.ring: list[torch.Tensor] = []
        self._ring_next = 0

    @property
    def step(self) -> int:
        return self.sync.step if self.mode == "sync" else self.policy.step

    @property
    def dropped_stale(self) -> int:
        return self.sync.dropped_stale + self.policy.dropped_stale

    # ------------------------------------------------------------------ replies
    def snapshot(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters copied into ``out``, or into the ring's next buffer; ``out`` the live
        parameters themselves (replicas that read them in place: shares_params): no copy."""
        if out is None:
            if len(self.ring) < self._ring_size:
                self.ring.append(torch.empty_like(self.param))
            out = self.ring[self._ring_next]
            self._ring_next = (self._ring_next + 1) % self._ring_size
        elif out is self.param:  # replicas read the parameters in place (shares_params): no copy
            if self.meter is not None:
                self.meter.bytes_out += self.meter.dense_bytes
            return out
        t0 = time.perf_counter()
        out.copy_(self.param)
        if self.meter is not None:
            self.meter.busy_s += time.perf_counter() - t0
            self.meter.bytes_out += self.meter.dense_bytes
        return out

    def reply(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int, bool, int]:
        """``(params, step, stop, generation)``; stop is also set by an error."""
        return self.snapshot(out), self.step, self.stop or self.error is not None, self.generation

    def sparse_reply(self, out: torch.Tensor | None, sparse: Sparse | None) -> Reply:
        """:meth:`reply`, with the rows of the next batch's ids when the request has a sparse block."""
        if sparse is None:
            return self.reply(out)
        rows = {} if self.error is not None else self.tables.gather(sparse)
        return (*self.reply(out), rows)

    # ------------------------------------------------------------------ the update
    def apply(self, grad: torch.Tensor, scale: float = 1.0) -> None:
        """One update: the optimizer step, then the step's bookkeeping (records, stop at the end)."""
        t0 = time.perf_counter()
        self.optimizer.step(self.param, grad, scale)
        if self.averages is not None:
            self.averages.update(self.param, self.step)
        self.tables.apply(scale)
        if self.meter is not None:
            self.meter.applies += 1
            self.meter.busy_s += time.perf_counter() - t0
        self.last_apply_time = time.time()
        self.after_apply()
        self.waits.tcond.notify_all()  # direct sync pushes waiting for this step (the caller holds lock)

    def after_apply(self) -> None:
        """The step's bookkeeping: a checkpoint_every hold, shard 0's records, the stop at ``steps``."""
        step = self.step
        if self.checkpoint_every and step % self.checkpoint_every == 0 and step < self.steps \
                and self.hold_at is None and (self.mode == "sync" or self.holds_global_step):
            # Pause at the checkpoint step until the chief has taken its snapshot and released
            # it: checkpoints land on exact multiples of every_steps however fast the steps are
            # (the chief polls every 0.1 s), so a lost ps costs at most every_steps steps. Sync:
            # every shard (they move in lockstep); async: the shard counting the global step (the
            # others' steps differ anyway: a push may be applied on one shard and dropped on another).
            self.hold_at = step
        if not self.holds_global_step:
            return
        if self.records.due(step, self.steps):
            self.records.close(step, self.dropped_stale)
        if step >= self.steps:
            self.stop = True

    def observe(self, replica: int, loss: float | None, samples: int, local_step: int) -> None:
        """A push's report (loss, samples, local step), counted on the shard holding the global
        step; a non-finite loss under nan_guard fails the run."""
        if not self.holds_global_step:
            return
        if not self.records.observe(replica, loss, samples, local_step) and self.nan_guard and self.error is None:
            self.error = (f"nan_guard: replica {replica} reported a non-finite loss ({loss}) at global "
                          f"step {self.step}; the update was not applied")

    # ------------------------------------------------------------------ refusals
    def bad_grad(self, grad: torch.Tensor, replica: int) -> bool:
        """Under nan_guard, a gradient with a value that is not finite fails the run (True)."""
        # (a finite sum means every value is finite, at a tenth of isfinite's cost; an overflowing
        # sum of finite values falls through to the exact check)
        if self.nan_guard and not math.isfinite(grad.sum()) and not bool(torch.isfinite(grad).all()):
            self.error = self.error or (f"nan_guard: replica {replica} pushed a non-finite gradient at step "
                                        f"{self.step} of shard {self.index}; the update was not applied")
            return True
        return False

    def bad_ids(self, sparse: Sparse | None, replica: int) -> bool:
        """An id outside its table (or not on this task) fails the run, naming the table and the id;
        nothing is read or written (a custom module may compute ids the data checks never saw)."""
        why = self.tables.why_bad(sparse)
        if why is None:
            return False
        self.error = self.error or f"replica {replica}: {why}"
        return True
