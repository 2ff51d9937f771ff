"""The parameter server: one shard of variables as one flat buffer, with its optimizer.

``ParameterShard`` is a plain class. The session creates it as a Dask Actor pinned to its ps
task's worker, but nothing here imports Dask: every public method is ``async def`` (it runs on
the worker's event loop, so a waiting sync replica never blocks other calls — a blocking method
would stall every actor on that worker) and only does brief tensor
math (an apply on a few MB takes well under a millisecond).

Wire protocol (one round trip per shard per step, one flat tensor each way):

- ``push_pull(grad, replica, version, ...)`` — async mode: apply at once, return fresh params.
- ``push_sync(grad, replica, version, ...)`` — sync mode: accumulate; return once the step that
  the gradient belongs to has been applied (or at once when the gradient is dropped as stale).
- ``pull(min_step)`` — the current params, waiting until the shard has reached ``min_step``.
- ``apply_mean(grad_sum, count, version)`` — in-graph replication (``dtrain.worker.tasks``): a task
  on this worker applies the mean of gradients that the step's graph already reduced.

Every reply is ``(params, step, stop, generation)``. ``params`` is a snapshot in a ring of
preallocated buffers, never the live buffer (the live one changes while a reply is on the wire).
Shard 0 holds the global step, the stop flag, the loss/throughput records and nan detection.

Its table parts are an object it owns, ``dtrain.ps.sparse.ShardTables`` (every request's sparse
work, called under the shard's lock). Its lease, stop and checkpoint-hold calls are the mixin
``dtrain.ps.control.ShardControl``; the
sync barrier (``push_sync``, ``excuse``, ``apply_mean``) is ``dtrain.ps.sync_push.SyncPush``, and
the pushes a data-plane connection thread runs itself are ``push_direct`` (ps/fastpath.py) and
``push_sync_direct`` (ps/sync_push.py). Its
load (pushes, busy time, bytes, staleness) is counted in a ``ShardMeter`` (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain.observe.meters import ShardMeter

from .averages import make_average
from .control import ShardControl
from .deltas import is_delta
from .fastpath import DirectPush
from .optim import make_optimizer
from .part_writer import BadPartError, PartWriter, check_part_file, cloned, drop_pages, read_part_file
from .replication import Apply, AsyncPolicy, StalenessGate
from .reshard import restore_part
from .rows import pack_state, unpack_state
from .sparse import Reply, ShardTables, Sparse, rows_bytes
from .sync_push import BarrierTimeout, SyncPush, fence
from .token_push import TokenPush, sync_for

__all__ = ["BarrierTimeout", "ParameterShard"]

logger = logging.getLogger(__name__)


class ParameterShard(ShardControl, TokenPush, SyncPush, DirectPush):
    """One ps task's variables and optimizer state (see the module docstring)."""

    def __init__(self, config: dict[str, Any], init: torch.Tensor):
        self.index: int = config["index"]
        self.mode: str = config["mode"]
        self.steps: int = config["steps"]
        self.generation: int = config.get("generation", 0)
        self.holds_global_step: bool = config.get("holds_global_step", self.index == 0)
        self.barrier_timeout_s: float = config.get("barrier_timeout_s", 60.0)
        self.summary_every: int = config.get("summary_every", 100)
        self.nan_guard: bool = config.get("nan_guard", False)
        num_replicas = self.num_replicas = config.get("num_replicas", 1)
        # Fencing: replica index -> the attempt the session submitted last.
        self.owners: dict[int, int] = {}
        if config.get("torch_threads"):
            # The apply's intra-op threads (else torch takes every core of the ps's machine, which
            # its replicas are using; dtrain worker processes get no OMP_NUM_THREADS).
            torch.set_num_threads(config["torch_threads"])
        # A plain tensor (no autograd) updated by a flat optimizer with torch.optim's semantics.
        self.param = init.detach().to(torch.float32).clone()
        self.optimizer = make_optimizer(self.param.numel(), config["optimizer"])
        self.averages = make_average(config.get("moving_average"), self.param)  # None: no EMA (ps/averages.py)
        # Sparse embedding tables: this task's rows of each, initialised here from the run's seed
        # (never shipped); a push carries (ids, row gradients) and asks for the next batch's rows.
        # A table with its own optimizer config uses it, the others the run's.
        # Parts that agree on their layout and row optimizer share buffers (ps/groups.py).
        self.incremental = bool(config.get("incremental"))  # checkpoint.incremental: tables track their changes
        self.tables = ShardTables(config.get("tables", ()), config["optimizer"], track=self.incremental,
                                  shard=self.index)
        # A sync step's gradient sum (ps/sync_push.py); async applies each push alone (no buffer).
        self.acc = torch.zeros_like(self.param) if self.mode == "sync" else torch.zeros(0)
        self._first: torch.Tensor | None = None  # a sync step's first gradient, read where it lies (ps/sync_push.py)
        self.sync = sync_for(config, num_replicas)  # the barrier, or TF's token queue (sync_tokens)
        self.policy = AsyncPolicy(config.get("max_staleness"))
        k = config.get("max_staleness")
        self.gate = StalenessGate(num_replicas, k) if (k is not None and self.holds_global_step) else None
        # Reply snapshots for the actor path, allocated on first use (the socket data plane passes
        # its own ``out`` buffer: a shared-memory slot or a per-connection buffer).
        self._ring_size = 2 * num_replicas + 4
        self._ring: list[torch.Tensor] = []
        self._ring_next = 0
        self._cond: asyncio.Condition | None = None
        self._waiting = 0  # waits on _cond in progress (a direct push wakes them: ps/fastpath.py)
        # Held by a push applied on a data-plane connection thread (ps/fastpath.py, ps/sync_push.py)
        # and by the event-loop methods around their reads and writes of the same state; direct
        # sync pushes wait for their step on _tcond (notified by every apply).
        self.lock = threading.Lock()
        self._tcond = threading.Condition(self.lock)
        self.stop = False
        self.error: str | None = None
        # Shard 0's bookkeeping: records closed at every summary_every global steps.
        self._interval = {"loss_sum": 0.0, "loss_n": 0, "samples": 0, "t0": time.time()}
        self.samples_total = 0
        self.records: list[dict[str, Any]] = []
        self.local_steps: dict[int, int] = {}
        self.last_apply_time = 0.0
        self._grace_until = 0.0  # monotonic time until which barrier waits may exceed their timeout
        # Checkpoint snapshots: applies pause once the step reaches hold_at, until release().
        self.hold_at: int | None = None
        # checkpoint.every_steps: pause by itself at every multiple (see _after_apply).
        self.checkpoint_every: int | None = config.get("checkpoint_every")
        # The chief's lease (module docstring): armed by the first renew(); None: no lease.
        self.lease_s: float | None = config.get("lease_s")
        self._lease: asyncio.TimerHandle | None = None
        self._expiry: asyncio.Task | None = None
        # Telemetry (observe.telemetry): pushes, applies, busy seconds, bytes, staleness.
        self.meter: ShardMeter | None = ShardMeter(self.param.numel() * 4) if config.get("telemetry", True) else None
        # This task's part of each checkpoint, written by itself (ps/part_writer.py), and the
        # checkpoint its tables' changes are counted from (its last snapshot, or the one restored):
        # an incremental checkpoint's part holds the rows changed since (ps/deltas.py).
        self.writer = PartWriter()
        self.checkpoint_base: int | None = None
        self._clearing: asyncio.Future[None] | None = None  # the previous snapshot's marks, cleared off the hold

    # ------------------------------------------------------------------ helpers (not remote)
    @property
    def step(self) -> int:
        return self.sync.step if self.mode == "sync" else self.policy.step

    @property
    def dropped_stale(self) -> int:
        return self.sync.dropped_stale + self.policy.dropped_stale

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily so it binds to the worker's running loop
            self._cond = asyncio.Condition()
        return self._cond

    def _snapshot(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            if len(self._ring) < self._ring_size:
                self._ring.append(torch.empty_like(self.param))
            out = self._ring[self._ring_next]
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

    @property
    def shares_params(self) -> bool:
        """Whether replicas on this machine may read the parameters in place instead of a snapshot
        (dataplane/shm.py, ``SharedParams``): sync pushes on the connection thread (no token queue,
        no sparse tables) and a quorum of every replica (no backup replicas, not elastic). Then no
        step is applied before every replica has pushed its gradient of the step before, so no
        replica reads while the ps writes; a replica that reads anyway (excused as lost, fenced
        off) pushes a stale gradient, which is dropped."""
        sync = self.sync
        return (self.direct_sync and not self.tables and getattr(sync, "fraction", 0) is None
                and getattr(sync, "replicas_to_aggregate", 0) == self.num_replicas)

    def adopt_params(self, buffer: torch.Tensor) -> None:
        """Move the parameters into ``buffer`` (shared memory) and keep them there."""
        with self.lock:
            buffer.copy_(self.param)
            self.param = buffer

    def _reply(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int, bool, int]:
        return self._snapshot(out), self.step, self.stop or self.error is not None, self.generation

    def _apply(self, grad: torch.Tensor, scale: float = 1.0) -> None:
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
        self._after_apply()
        self._tcond.notify_all()  # direct sync pushes waiting for this step (the caller holds lock)

    def _observe(self, replica: int, loss: float | None, samples: int, local_step: int) -> None:
        if not self.holds_global_step:
            return
        self.samples_total += samples
        self._interval["samples"] += samples
        if loss is not None:
            if not math.isfinite(loss):
                if self.nan_guard and self.error is None:
                    self.error = (f"nan_guard: replica {replica} reported a non-finite loss ({loss}) at global "
                                  f"step {self.step}; the update was not applied")
                return
            self._interval["loss_sum"] += loss
            self._interval["loss_n"] += 1
        self.local_steps[replica] = local_step

    def _after_apply(self) -> None:
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
        if step % self.summary_every == 0 or step == self.steps:
            now = time.time()
            iv = self._interval
            dt = max(now - iv["t0"], 1e-9)
            self.records.append({
                "step": step, "time": now,
                "loss": iv["loss_sum"] / iv["loss_n"] if iv["loss_n"] else None,
                "samples_per_sec": iv["samples"] / dt, "dropped_stale": self.dropped_stale,
                "samples": self.samples_total,
            })
            self._interval = {"loss_sum": 0.0, "loss_n": 0, "samples": 0, "t0": now}
        if step >= self.steps:
            self.stop = True

    def _still_held(self, version: int | None) -> bool:
        """Re-checked under ``lock`` after ``_wait_unheld``: held, and not released by a stop or an
        error (which end that wait too: the caller then answers at once, else it would spin)."""
        return self._held(version) and not self.stop and self.error is None

    def _held(self, version: int | None) -> bool:
        if self.hold_at is None or self.step < self.hold_at:
            return False
        return version is None or version >= self.hold_at  # else it completes the step being waited for

    async def _wait_unheld(self, version: int | None = None) -> None:
        """Pause a push while a snapshot is being taken (applies must not move the parameters)."""
        if not self._held(version):
            return
        cond = self._condition()
        async with cond:
            await self._wait(cond, lambda: not self._held(version) or self.stop or self.error is not None,
                             f"a push on shard {self.index} waited for a checkpoint snapshot")

    def _bad_grad(self, grad: torch.Tensor, replica: int) -> bool:
        # (a finite sum means every value is finite, at a tenth of isfinite's cost; an overflowing
        # sum of finite values falls through to the exact check)
        if self.nan_guard and not math.isfinite(grad.sum()) and not bool(torch.isfinite(grad).all()):
            self.error = self.error or (f"nan_guard: replica {replica} pushed a non-finite gradient at step "
                                        f"{self.step} of shard {self.index}; the update was not applied")
            return True
        return False

    # ------------------------------------------------------------------ remote methods
    def _push_async(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                    local_step: int, sparse: Sparse | None = None) -> None:
        """An async push's bookkeeping, then its apply unless it is too stale or bad (the caller
        holds ``lock``: ``push_pull`` on the event loop, ``push_direct`` on a connection thread)."""
        self._observe(replica, loss, samples, local_step)
        if self.meter is not None:
            self.meter.push(rows_bytes(sparse) if sparse else 0, self.step - version, loss)
        if self.error is None and not self._bad_grad(grad, replica) and isinstance(self.policy.push(version), Apply):
            self.tables.add(sparse)
            self._apply(grad)

    async def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                        samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                        sparse: Sparse | None = None, attempt: int | None = None) -> Reply:
        """Async mode: apply this gradient now (unless too stale), reply with fresh parameters.
        ``sparse``: table name -> (ids, their row gradients, the next batch's ids); the reply then
        has a fifth element, table name -> the rows of the next batch's ids. ``attempt``: the
        replica's submission (actor calls; FencedOff when the session replaced it: set_owner)."""
        fence(self.owners, replica, attempt)
        while True:
            await self._wait_unheld()
            with self.lock:
                if self._still_held(None):  # a direct push's step paused the shard meanwhile (ps/fastpath.py)
                    continue
                if self.stop or self.error is not None or self._bad_ids(sparse, replica):
                    return self._sparse_reply(out, sparse)
                self._push_async(grad, replica, version, loss, samples, local_step, sparse)
                if self.gate is None:
                    return self._sparse_reply(out, sparse)
                break
        if self.gate is not None:  # (no direct pushes with a gate: no lock below)
            self.gate.report(replica, local_step)
            cond = self._condition()
            async with cond:
                cond.notify_all()
                if not self.gate.may_proceed(replica, local_step + 1):
                    await self._wait(cond, lambda: self.stop or self.gate.may_proceed(replica, local_step + 1),
                                     f"replica {replica} waited for slower replicas (max_staleness "
                                     f"{self.gate.max_staleness})")
        return self._sparse_reply(out, sparse)

    async def pull(self, min_step: int = 0, out: torch.Tensor | None = None, sparse: Sparse | None = None) -> Reply:
        """The current parameters, once this shard has applied ``min_step`` steps. ``out`` (here
        and in the pushes): write the reply's snapshot there instead of into the ring. ``sparse``:
        as for the pushes (only the ids to gather count)."""
        if self.step < min_step and not self.stop:
            cond = self._condition()
            async with cond:
                await self._wait(cond, lambda: self.step >= min_step or self.stop or self.error is not None,
                                 f"pull waited for shard {self.index} to reach step {min_step}")
        with self.lock:
            if sparse is not None and self._bad_ids({k: (None, None, v[2]) for k, v in sparse.items()}, -1):
                return self._sparse_reply(out, {})
            return self._sparse_reply(out, sparse)

    def _bad_ids(self, sparse: Sparse | None, replica: int) -> bool:
        """An id outside its table (or not on this task) fails the run, naming the table and the id;
        nothing is read or written (a custom module may compute ids the data checks never saw)."""
        why = self.tables.why_bad(sparse)
        if why is None:
            return False
        self.error = self.error or f"replica {replica}: {why}"
        return True

    async def gather_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of table ``name`` (global ``ids`` held by this task): evaluation and ``model.pt``."""
        with self.lock:  # (a fixed table draws rows on first use; a direct push may be applying)
            return self.tables.lookup(name, ids)  # (a table without a vocabulary admits no id for an evaluation)

    async def read_part(self, name: str, start: int, stop: int) -> dict[str, Any]:
        """Local rows ``[start, stop)`` of this task's part of table ``name`` and their optimizer
        state (copies of that chunk only): a checkpoint reads a part in chunks, so the ps never
        holds a second copy of its table (the chief holds applies while it reads). Packed for Dask
        (bfloat16 rows as int16 bits: :func:`dtrain.ps.rows.unpack_state`)."""
        with self.lock:
            return pack_state(self.tables[name].chunk(start, stop))

    def _sparse_reply(self, out: torch.Tensor | None, sparse: Sparse | None) -> Reply:
        if sparse is None:
            return self._reply(out)
        rows = {} if self.error is not None else self.tables.gather(sparse)
        return (*self._reply(out), rows)


    async def _wait(self, cond: asyncio.Condition, predicate: Any, what: str) -> None:
        """Wait for ``predicate`` for barrier_timeout_s, or longer while a grace granted by the
        session (:meth:`barrier_grace`: a lost replica is being restarted) has not run out."""
        t0 = time.monotonic()
        self._waiting += 1
        try:
            while True:
                remaining = self._remaining(t0, what)
                try:
                    await asyncio.wait_for(cond.wait_for(predicate), remaining)
                    return
                except (asyncio.TimeoutError, TimeoutError):
                    continue  # a grace may have been granted meanwhile: check again
        finally:
            self._waiting -= 1

    def _remaining(self, t0: float, what: str) -> float:
        """Seconds a wait begun at ``t0`` (monotonic) may still last: barrier_timeout_s, or longer
        while a session's grace runs; BarrierTimeout once none are left (this wait and the
        connection threads' in ps/sync_push.py)."""
        remaining = max(t0 + self.barrier_timeout_s, self._grace_until) - time.monotonic()
        if remaining <= 0:
            raise BarrierTimeout(f"{what} for {time.monotonic() - t0:.0f} s (training.barrier_timeout_s: "
                                 f"{self.barrier_timeout_s:.0f}); a replica is probably lost")
        return remaining

    @property
    def grace_until(self) -> float:
        """Monotonic time until which waits may exceed their barrier timeout (the data-plane
        server waits on requests that long)."""
        return self._grace_until

    async def set_owner(self, replica: int, attempt: int) -> None:
        """The session's (re)submission ``attempt`` owns ``replica``: pushes from its other
        attempts (a hung replica that came back after its replacement) are refused, on the socket
        data plane and on actor calls that say their attempt alike."""
        self.owners[replica] = attempt

    async def current_step(self) -> int:
        return self.step

    async def barrier_grace(self, seconds: float) -> None:
        """Let waits outlast their barrier timeout by ``seconds`` from now (a lost replica restarts)."""
        self._grace_until = max(self._grace_until, time.monotonic() + seconds)

    async def stats(self) -> dict[str, Any]:
        """Progress for the session: drains the summary records collected since the last call."""
        with self.lock:
            records, self.records = self.records, []
            return {"step": self.step, "stop": self.stop, "error": self.error, "records": records,
                    "dropped_stale": self.dropped_stale, "samples": self.samples_total,
                    "local_steps": dict(self.local_steps), "generation": self.generation,
                    "last_apply_time": self.last_apply_time}

    async def load(self) -> dict[str, Any] | None:
        """The shard's telemetry (``ShardMeter.snapshot`` and the pushes dropped); None when off."""
        with self.lock:
            if self.meter is None:
                return None
            out = {**self.meter.snapshot(), "dropped": self.dropped_stale}
            if self.tables:  # each table part's rows and counters (dtrain_table_* series)
                out["tables"] = self.tables.stats()
            return out

    async def table_stats(self) -> dict[str, dict[str, int]]:
        """Per table, this task's part: rows held, bytes, and for a table without a vocabulary the
        ids admitted, rows evicted and gradients rejected so far (summary.json's ``tables``)."""
        with self.lock:
            return self.tables.stats()

    async def get_params(self, averaged: bool = False) -> tuple[torch.Tensor, int]:
        """The parameters (``averaged``: their moving averages, when the shard keeps them)."""
        with self.lock:
            return (self.averages.state() if averaged and self.averages else self.param.clone()), self.step

    async def get_state(self, tables: bool = True) -> dict[str, Any]:
        """Parameters, optimizer state and step, for a checkpoint (plain dict: no OrderedDict).
        ``tables``: with the table parts (copied whole; the chief's snapshots read them in chunks
        instead, :meth:`read_part`), packed for Dask (bfloat16 rows as int16 bits:
        ``dtrain.ps.rows.unpack_state``)."""
        with self.lock:
            out = {"params": self.param.clone(), "step": self.step, "optimizer_state": self.optimizer.state_dict(),
                   "dropped_stale": self.dropped_stale, "samples": self.samples_total}
            if self.averages is not None:
                out["averages"] = self.averages.state()
            if self.tables and tables:  # copies: an in-process caller would otherwise keep live tensors
                out["tables"] = {name: pack_state(part.state(copy=True)) for name, part in self.tables.items()}
        return out

    async def set_state(self, state: dict[str, Any], done: Any = None) -> int:
        """Restore from :meth:`get_state`'s output (a checkpoint; ``done``: ``TablePart.load_state``'s),
        or lay a delta part over the state restored (ps/deltas.py). The next checkpoint's part is
        full unless :meth:`load_part` names the checkpoint restored."""
        with self.lock:
            self.checkpoint_base = None
            with torch.no_grad():
                self.param.copy_(state["params"])
            self.optimizer.load_state_dict(dict(state.get("optimizer_state") or {}))
            if self.averages is not None:
                self.averages.load(state.get("averages"), self.param)
            for name, part in self.tables.items():
                if name in (state.get("tables") or {}):
                    table = unpack_state(state["tables"][name])
                    if table.get("delta"):
                        part.load_delta(table)
                    else:
                        part.load_state(table, done)
            self.tables.clear()
            step = int(state["step"])
            self.sync.reset(step)
            self.policy.reset(step)
            if self.gate is not None:
                self.gate.reset()
            self.sync.dropped_stale = int(state.get("dropped_stale", 0))
            self.samples_total = int(state.get("samples", 0))
            self.acc.zero_()
            self._first = None
            self.stop = step >= self.steps
            self._tcond.notify_all()
            return step

    # ------------------------------------------------------------------ checkpoint parts
    def _part_state(self, delta: bool) -> dict[str, Any] | Callable[[], dict[str, Any]]:
        """This task's part of a checkpoint (holding ``lock``, applies held): the dense state copied
        (small; the parameters may be in shared memory, which a forked writer sees change), the
        tables' live tensors (a forked writer sees them as they are now: copy-on-write); ``delta``:
        each table's rows changed since the last snapshot instead, picked out in the writer."""
        dense = {"params": self.param.clone(), "step": self.step, "optimizer_state": cloned(self.optimizer.state_dict()),
                 "dropped_stale": self.dropped_stale, "samples": self.samples_total,
                 **({"averages": self.averages.state()} if self.averages is not None else {})}
        if not self.tables:
            return dense
        if not delta:
            return {**dense, "tables": {n: part.live_state() for n, part in self.tables.items()}}
        tables = self.tables
        return lambda: {**dense, "tables": {n: part.delta_state() for n, part in tables.items()}}

    async def write_part(self, directory: str, name: str, tag: int | None = None, since: int | None = None
                         ) -> dict[str, Any]:
        """Start writing this task's part of the checkpoint ``tag`` (its step) of the held step
        (``PartWriter.start``): a delta of the checkpoint ``since`` when that is the one this task
        counts its changes from (``checkpoint_base``), else a full part (the report's ``kind``).
        ``{"error": ...}`` when the parameters are not finite or a part is still being written."""
        if self._clearing is not None:  # (the marks the previous snapshot left: cleared long since)
            await self._clearing
            self._clearing = None
        with self.lock:
            if not bool(torch.isfinite(self.param).all()):
                return {"error": f"the parameters of shard {self.index} became non-finite (NaN or inf) at step "
                                 f"{self.step}"}
            delta = self.incremental and bool(self.tables) and since is not None and since == self.checkpoint_base
            meta = {"kind": "delta", "base": since} if delta else {"kind": "full"}
            out = self.writer.start(directory, name, self._part_state(delta), self.step, meta)
            if "error" not in out:  # (the writer holds its snapshot: count the changes from here)
                self.tables.snapshot_taken()
                self.checkpoint_base = tag
                if self.incremental:
                    self._clearing = asyncio.get_running_loop().run_in_executor(None, self.tables.clear_spare_marks)
            return out

    async def part_written(self, wait: bool = False) -> dict[str, Any] | None:
        """The last part's outcome (``PartWriter.poll``); None while it is being written."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.writer.poll, True) if wait else self.writer.poll()

    async def load_part(self, chain: list[tuple[str, int, str]], tag: int | None = None) -> int:
        """Restore this task from its part of the checkpoint ``tag``: ``chain`` is the files that
        hold it, (path, bytes, sha256) each, a full part then the deltas that follow it, each read
        and verified here (BadPartError unless its size and sha256 are the manifest's) and applied
        in turn; returns the step."""
        loop = asyncio.get_running_loop()
        step = 0
        for k, (path, nbytes, sha256) in enumerate(chain):
            state = await loop.run_in_executor(None, read_part_file, path, nbytes, sha256)
            if k == 0 and is_delta(state):
                raise BadPartError(f"{path}: a delta where its chain needs a full part")
            step = await self.set_state(state, done=drop_pages)
            del state
        self.checkpoint_base = tag
        return step

    async def check_files(self, files: list[tuple[str, int, str]]) -> int:
        """Check checkpoint files (path, bytes, sha256) against their manifest here, on this task
        (``check_part_file``: BadPartError naming the first bad one); returns how many. A restore
        under another placement has each file checked once, by one task, before any is read."""
        loop = asyncio.get_running_loop()
        for path, nbytes, sha256 in files:
            await loop.run_in_executor(None, check_part_file, path, nbytes, sha256)
        return len(files)

    async def load_resharded(self, dense: dict[str, Any], tables: list[dict[str, Any]]) -> int:
        """Restore this task from a checkpoint written under another placement: ``dense``, its
        dense state (resharded by the chief, which reads only the parts' dense state), then each of
        its table parts from every old part's chain (``tables``: per table ``name``,
        ``num_embeddings`` (None without a vocabulary), ``old`` and ``new`` (parts, strategy),
        ``part`` (this task's) and ``chains``: per old part its files, (path, bytes, sha256), full
        first, checked already by :meth:`check_files`), reading only the rows it owns
        (ps/reshard.py). Returns the step; the next checkpoint's part is full."""
        step = await self.set_state(dense)
        loop = asyncio.get_running_loop()
        opened: dict[str, dict[str, Any]] = {}  # each file opened once (memory-mapped), whatever its tables
        for table in tables:
            part = self.tables[table["name"]]
            chains = []
            for files in table["chains"]:
                for path, nbytes, sha in files:
                    if path not in opened:
                        opened[path] = await loop.run_in_executor(None, read_part_file, path, nbytes, sha, False)
                chains.append([unpack_state(opened[path]["tables"][table["name"]]) for path, _, _ in files])
            with self.lock:
                restore_part(part, chains, table["num_embeddings"], tuple(table["old"]), tuple(table["new"]),
                             int(table["part"]))
            del chains
        return step

    # ------------------------------------------------------------------ socket data plane
    async def open_data_plane(self, secret: bytes, host: str = "127.0.0.1",
                              tls: dict[str, str | None] | None = None, wire_dtype: str = "float32",
                              share_params: bool = False) -> tuple[str, int]:
        """Start serving this shard over TCP (``training.transport: socket``); returns (host, port).
        ``share_params``: replicas on this machine may read the parameters in place where the
        shard allows it (``shares_params``; ``training.shared_memory``).

        Requests still run here, on this worker's event loop, through the methods above."""
        from dtrain.dataplane.protocol import server_ssl_context
        from dtrain.dataplane.server import ShardServer

        if getattr(self, "_server", None) is None:
            ctx = server_ssl_context(tls) if tls else None
            self._server = ShardServer(self, asyncio.get_running_loop(), secret, host=host, ssl_context=ctx,
                                       timeout=max(self.barrier_timeout_s, 60.0) + 60.0, wire_dtype=wire_dtype,
                                       share_params=share_params)
        return self._server.host, self._server.port

    async def close_data_plane(self) -> dict[str, int]:
        """Stop serving; returns how many replica connections it served, how many of them through
        shared memory, and how many of those read the parameters in place."""
        server = getattr(self, "_server", None)
        if server is None:
            return {"connections": 0, "shared_memory": 0, "in_place": 0}
        server.close()
        self._server = None
        return {"connections": server.connections, "shared_memory": server.shared_connections,
                "in_place": server.in_place_connections}

    def __del__(self) -> None:
        for owned in (getattr(self, "_server", None), getattr(self, "writer", None)):
            if owned is not None:
                owned.close()

