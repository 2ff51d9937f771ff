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

The shard is built of parts it owns, each an object with its own state that is given, when the
shard creates it, the parts it works with; the shard's remote methods delegate to them:

- ``waits``, :class:`~dtrain.ps.waits.ShardWaits` — the lock, the conditions waiters sleep on
  (the event loop's and the connection threads'), the barrier timeout and the session's grace;
- ``core``, :class:`~dtrain.ps.core.ShardCore` — the state every part shares: the parameters,
  the optimizer, the table parts (:class:`~dtrain.ps.sparse.ShardTables`, every request's sparse
  work, called under the lock), the step's source, the stop and error flags, the hold step, the
  meter (load: pushes, busy time, bytes, staleness; docs/observability.md); the apply and the reply;
- ``control``, :class:`~dtrain.ps.control.ShardControl` — the chief's lease, stop and
  checkpoint-hold calls, and the holds every push obeys;
- ``async_push``, :class:`~dtrain.ps.fastpath.AsyncPush` — ``push_pull``, and ``push_direct``
  on a data-plane connection thread;
- ``barrier``, :class:`~dtrain.ps.sync_push.SyncBarrier` — the sync barrier: ``push_sync``,
  ``push_sync_direct`` on a connection thread, ``excuse``, ``apply_mean``; with ``gradients``,
  the step's :class:`~dtrain.ps.sync_push.GradientSum`;
- ``token_push``, :class:`~dtrain.ps.token_push.TokenPush` — ``push_sync`` under
  ``training.sync_tokens`` (None without).

The shard itself keeps the fencing of replaced replicas (``owners``), its part of each
checkpoint (ps/part_writer.py) and its data-plane server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from dtrain.observe.meters import ShardMeter

from .control import ShardControl
from .core import ShardCore
from .deltas import is_delta
from .fastpath import AsyncPush
from .part_writer import BadPartError, PartWriter, check_part_file, cloned, drop_pages, read_part_file
from .reshard import restore_part
from .rows import pack_state, unpack_state
from .sparse import Reply, ShardTables, Sparse
from .sync_push import GradientSum, SyncBarrier, fence
from .token_push import TokenPush
from .tokens import TokenSync
from .waits import BarrierTimeout, ShardWaits

__all__ = ["BarrierTimeout", "ParameterShard"]

logger = logging.getLogger(__name__)


class ParameterShard:
    """One ps task's variables and optimizer state (see the module docstring)."""

    def __init__(self, config: dict[str, Any], init: torch.Tensor):
        # Fencing: replica index -> the attempt the session submitted last.
        self.owners: dict[int, int] = {}
        if config.get("torch_threads"):
            # The apply's intra-op threads (else torch takes every core of the ps's machine, which
            # its replicas are using; dtrain worker processes get no OMP_NUM_THREADS).
            torch.set_num_threads(config["torch_threads"])
        self.waits = ShardWaits(config.get("barrier_timeout_s", 60.0))
        self.core = core = ShardCore(config, init, self.waits)
        self.control = ShardControl(core, self.waits, config.get("lease_s"))
        self.async_push = AsyncPush(core, self.waits, self.control)
        # A sync step's gradient sum (ps/sync_push.py); async applies each push alone (no buffer).
        self.gradients = GradientSum(core.param, core.mode == "sync")
        self.barrier = SyncBarrier(core, self.waits, self.control, self.gradients)
        self.token_push = (TokenPush(core, self.waits, self.control, self.barrier, core.sync)
                           if isinstance(core.sync, TokenSync) else None)
        # This task's part of each checkpoint, written by itself (ps/part_writer.py), and the
        # checkpoint its tables' changes are counted from (its last snapshot, or the one restored):
        # an incremental checkpoint's part holds the rows changed since (ps/deltas.py).
        self.incremental = bool(config.get("incremental"))  # checkpoint.incremental: tables track their changes
        self.writer = PartWriter()
        self.checkpoint_base: int | None = None
        self._clearing: asyncio.Future[None] | None = None  # the previous snapshot's marks, cleared off the hold

    # ------------------------------------------------------------------ the state callers read
    @property
    def index(self) -> int:
        return self.core.index

    @property
    def num_replicas(self) -> int:
        return self.core.num_replicas

    @property
    def param(self) -> torch.Tensor:
        """The live parameters (the data plane's replicas may read them in place: shares_params)."""
        return self.core.param

    @property
    def tables(self) -> ShardTables:
        return self.core.tables

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def stop(self) -> bool:
        return self.core.stop

    @property
    def error(self) -> str | None:
        return self.core.error

    @property
    def hold_at(self) -> int | None:
        return self.core.hold_at

    @property
    def dropped_stale(self) -> int:
        return self.core.dropped_stale

    @property
    def meter(self) -> ShardMeter | None:
        """The shard's ``ShardMeter`` (None: telemetry off)."""
        return self.core.meter

    @property
    def grace_until(self) -> float:
        """Monotonic time until which waits may exceed their barrier timeout (the data-plane
        server waits on requests that long)."""
        return self.waits.grace_until

    @property
    def data_plane(self) -> Any:
        """The data-plane server serving this shard (``open_data_plane``), or None."""
        return self.control.data_plane

    @property
    def direct_pushes(self) -> bool:
        """Whether async pushes may be applied on the connection thread (ps/fastpath.py)."""
        return self.async_push.direct

    @property
    def direct_sync(self) -> bool:
        """Whether sync pushes may run on the connection thread (ps/sync_push.py)."""
        return self.barrier.direct

    @property
    def shares_params(self) -> bool:
        """Whether replicas on this machine may read the parameters in place instead of a snapshot
        (dataplane/shm.py, ``SharedParams``): sync pushes on the connection thread (no token queue,
        no sparse tables) and a quorum of every replica (no backup replicas, not elastic). Then no
        step is applied before every replica has pushed its gradient of the step before, so no
        replica reads while the ps writes; a replica that reads anyway (excused as lost, fenced
        off) pushes a stale gradient, which is dropped."""
        sync = self.core.sync
        return (self.direct_sync and not self.core.tables and getattr(sync, "fraction", 0) is None
                and getattr(sync, "replicas_to_aggregate", 0) == self.core.num_replicas)

    def adopt_params(self, buffer: torch.Tensor) -> None:
        """Move the parameters into ``buffer`` (shared memory) and keep them there."""
        with self.waits.lock:
            buffer.copy_(self.core.param)
            self.core.param = buffer

    async def _wait_unheld(self, version: int | None = None) -> None:
        """Pause while a checkpoint snapshot holds the shard (``ShardControl.wait_unheld``)."""
        await self.control.wait_unheld(version)

    # ------------------------------------------------------------------ pushes and pulls
    async def push_pull(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                        samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                        sparse: Sparse | None = None, attempt: int | None = None) -> Reply:
        """Async mode: apply this gradient now (unless too stale), reply with fresh parameters.
        ``sparse``: table name -> (ids, their row gradients, the next batch's ids); the reply then
        has a fifth element, table name -> the rows of the next batch's ids. ``attempt``: the
        replica's submission (actor calls; FencedOff when the session replaced it: set_owner)."""
        fence(self.owners, replica, attempt)
        return await self.async_push.push_pull(grad, replica, version, loss, samples, local_step, out, sparse)

    def push_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                    loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                    sparse: Any = None, respond: Callable[[tuple], None] | None = None) -> tuple | None:
        """``push_pull`` on the calling data-plane connection thread, or None where it must run on
        the event loop (``AsyncPush.push_direct``; :attr:`direct_pushes` is the caller's check).
        ``respond``: unused (an async push never waits for another's), the sync push's signature."""
        return self.async_push.push_direct(loop, grad, replica, version, loss, samples, local_step, out, sparse)

    async def push_sync(self, grad: torch.Tensor, replica: int, version: int, loss: float | None = None,
                        samples: int = 0, local_step: int = 0, out: torch.Tensor | None = None,
                        sparse: Sparse | None = None, attempt: int | None = None) -> Reply:
        """Sync mode: accumulate for the current step; the quorum's last gradient applies the mean
        (of the dense gradients, and of the row gradients: summed per id, divided by the count).
        ``attempt``: the replica's submission (actor calls; FencedOff when it was replaced)."""
        fence(self.owners, replica, attempt)
        if self.token_push is not None:  # training.sync_tokens: TF's token queue (ps/token_push.py)
            return await self.token_push.push(grad, replica, version, loss, samples, local_step, out, sparse)
        return await self.barrier.push(grad, replica, version, loss, samples, local_step, out, sparse)

    def push_sync_direct(self, loop: asyncio.AbstractEventLoop, grad: torch.Tensor, replica: int, version: int,
                         loss: float | None, samples: int, local_step: int, out: torch.Tensor,
                         sparse: Sparse | None = None, respond: Callable[[tuple], None] | None = None) -> Any:
        """``push_sync`` on the calling data-plane connection thread, or None where it must run on
        the event loop (``SyncBarrier.push_direct``; :attr:`direct_sync` is the caller's check).
        ``respond``: sends this push's reply (then ``ANSWERED`` may come back: it was sent)."""
        return self.barrier.push_direct(loop, grad, replica, version, loss, samples, local_step, out, sparse, respond)

    async def excuse(self, replica: int, at_step: int | None, how: str = "excuse") -> int:
        """Sync: lost ``replica`` will not push for step ``at_step``; ``how``: ``excuse``,
        ``retire`` or ``rejoin`` (``SyncBarrier.excuse``). Returns the step."""
        return await self.barrier.excuse(replica, at_step, how)

    async def apply_mean(self, grad_sum: torch.Tensor, count: int, version: int, loss: float | None = None,
                         samples: int = 0) -> int:
        """In-graph replication: apply ``grad_sum / count`` as one sync step of ``version``
        (``SyncBarrier.apply_mean``). Returns the shard's step afterwards."""
        return await self.barrier.apply_mean(grad_sum, count, version, loss, samples)

    async def pull(self, min_step: int = 0, out: torch.Tensor | None = None, sparse: Sparse | None = None) -> Reply:
        """The current parameters, once this shard has applied ``min_step`` steps. ``out`` (here
        and in the pushes): write the reply's snapshot there instead of into the ring. ``sparse``:
        as for the pushes (only the ids to gather count)."""
        core = self.core
        if core.step < min_step and not core.stop:
            cond = self.waits.condition()
            async with cond:
                await self.waits.wait(cond, lambda: core.step >= min_step or core.stop or core.error is not None,
                                      f"pull waited for shard {core.index} to reach step {min_step}")
        with self.waits.lock:
            if sparse is not None and core.bad_ids({k: (None, None, v[2]) for k, v in sparse.items()}, -1):
                return core.sparse_reply(out, {})
            return core.sparse_reply(out, sparse)

    async def gather_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of table ``name`` (global ``ids`` held by this task): evaluation and ``model.pt``."""
        with self.waits.lock:  # (a fixed table draws rows on first use; a direct push may be applying)
            return self.core.tables.lookup(name, ids)  # (a table without a vocabulary admits no id for an evaluation)

    async def read_part(self, name: str, start: int, stop: int) -> dict[str, Any]:
        """Local rows ``[start, stop)`` of this task's part of table ``name`` and their optimizer
        state (copies of that chunk only): a checkpoint reads a part in chunks, so the ps never
        holds a second copy of its table (the chief holds applies while it reads). Packed for Dask
        (bfloat16 rows as int16 bits: :func:`dtrain.ps.rows.unpack_state`)."""
        with self.waits.lock:
            return pack_state(self.core.tables[name].chunk(start, stop))

    # ------------------------------------------------------------------ the chief's control calls
    async def renew(self) -> int:
        """The chief is alive: the lease runs on (``ShardControl.renew``)."""
        return await self.control.renew()

    async def stop_at(self, step: int) -> int:
        """End training at global step ``step`` (a stop_at_step hook), as at ``training.steps``:
        the update of that step is the last one applied."""
        return await self.control.stop_at(step)

    async def request_stop(self) -> int:
        """Ask every replica to stop at its next reply; releases waiting replicas."""
        return await self.control.request_stop()

    async def hold(self, at_step: int | None = None) -> int:
        """Pause applies from ``at_step`` on (default: now); returns the current step."""
        return await self.control.hold(at_step)

    async def wait_held(self) -> int:
        """Return once the shard has reached its hold step (sync: the step the snapshot needs)."""
        return await self.control.wait_held()

    async def release(self) -> int:
        """End a hold: waiting pushes go on."""
        return await self.control.release()

    async def set_owner(self, replica: int, attempt: int) -> None:
        """The session's (re)submission ``attempt`` owns ``replica``: pushes from its other
        attempts (a hung replica that came back after its replacement) are refused, on the socket
        data plane and on actor calls that say their attempt alike."""
        self.owners[replica] = attempt

    async def current_step(self) -> int:
        return self.core.step

    async def barrier_grace(self, seconds: float) -> None:
        """Let waits outlast their barrier timeout by ``seconds`` from now (a lost replica restarts)."""
        self.waits.grant_grace(seconds)

    async def stats(self) -> dict[str, Any]:
        """Progress for the session: drains the summary records collected since the last call."""
        core = self.core
        with self.waits.lock:
            records = core.records.drain()
            return {"step": core.step, "stop": core.stop, "error": core.error, "records": records,
                    "dropped_stale": core.dropped_stale, "samples": core.records.samples_total,
                    "local_steps": dict(core.records.local_steps), "generation": core.generation,
                    "last_apply_time": core.last_apply_time}

    async def load(self) -> dict[str, Any] | None:
        """The shard's telemetry (``ShardMeter.snapshot`` and the pushes dropped); None when off."""
        core = self.core
        with self.waits.lock:
            if core.meter is None:
                return None
            out = {**core.meter.snapshot(), "dropped": core.dropped_stale}
            if core.tables:  # each table part's rows and counters (dtrain_table_* series)
                out["tables"] = core.tables.stats()
            return out

    async def table_stats(self) -> dict[str, dict[str, int]]:
        """Per table, this task's part: rows held, bytes, and for a table without a vocabulary the
        ids admitted, rows evicted and gradients rejected so far (summary.json's ``tables``)."""
        with self.waits.lock:
            return self.core.tables.stats()

    async def get_params(self, averaged: bool = False) -> tuple[torch.Tensor, int]:
        """The parameters (``averaged``: their moving averages, when the shard keeps them)."""
        core = self.core
        with self.waits.lock:
            return (core.averages.state() if averaged and core.averages else core.param.clone()), core.step

    async def get_state(self, tables: bool = True) -> dict[str, Any]:
        """Parameters, optimizer state and step, for a checkpoint (plain dict: no OrderedDict).
        ``tables``: with the table parts (copied whole; the chief's snapshots read them in chunks
        instead, :meth:`read_part`), packed for Dask (bfloat16 rows as int16 bits:
        ``dtrain.ps.rows.unpack_state``)."""
        core = self.core
        with self.waits.lock:
            out = {"params": core.param.clone(), "step": core.step, "optimizer_state": core.optimizer.state_dict(),
                   "dropped_stale": core.dropped_stale, "samples": core.records.samples_total}
            if core.averages is not None:
                out["averages"] = core.averages.state()
            if core.tables and tables:  # copies: an in-process caller would otherwise keep live tensors
                out["tables"] = {name: pack_state(part.state(copy=True)) for name, part in core.tables.items()}
        return out

    async def set_state(self, state: dict[str, Any], done: Any = None) -> int:
        """Restore from :meth:`get_state`'s output (a checkpoint; ``done``: ``TablePart.load_state``'s),
        or lay a delta part over the state restored (ps/deltas.py). The next checkpoint's part is
        full unless :meth:`load_part` names the checkpoint restored."""
        core = self.core
        with self.waits.lock:
            self.checkpoint_base = None
            with torch.no_grad():
                core.param.copy_(state["params"])
            core.optimizer.load_state_dict(dict(state.get("optimizer_state") or {}))
            if core.averages is not None:
                core.averages.load(state.get("averages"), core.param)
            for name, part in core.tables.items():
                if name in (state.get("tables") or {}):
                    table = unpack_state(state["tables"][name])
                    if table.get("delta"):
                        part.load_delta(table)
                    else:
                        part.load_state(table, done)
            core.tables.clear()
            step = int(state["step"])
            core.sync.reset(step)
            core.policy.reset(step)
            if core.gate is not None:
                core.gate.reset()
            core.sync.dropped_stale = int(state.get("dropped_stale", 0))
            core.records.samples_total = int(state.get("samples", 0))
            self.gradients.reset()
            core.stop = step >= core.steps
            self.waits.tcond.notify_all()
            return step

    # ------------------------------------------------------------------ checkpoint parts
    def _part_state(self, delta: bool) -> dict[str, Any] | Callable[[], dict[str, Any]]:
        """This task's part of a checkpoint (holding ``lock``, applies held): the dense state copied
        (small; the parameters may be in shared memory, which a forked writer sees change), the
        tables' live tensors (a forked writer sees them as they are now: copy-on-write); ``delta``:
        each table's rows changed since the last snapshot instead, picked out in the writer."""
        core = self.core
        dense = {"params": core.param.clone(), "step": core.step, "optimizer_state": cloned(core.optimizer.state_dict()),
                 "dropped_stale": core.dropped_stale, "samples": core.records.samples_total,
                 **({"averages": core.averages.state()} if core.averages is not None else {})}
        if not core.tables:
            return dense
        if not delta:
            return {**dense, "tables": {n: part.live_state() for n, part in core.tables.items()}}
        tables = core.tables
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
        core = self.core
        with self.waits.lock:
            if not bool(torch.isfinite(core.param).all()):
                return {"error": f"the parameters of shard {core.index} became non-finite (NaN or inf) at step "
                                 f"{core.step}"}
            delta = self.incremental and bool(core.tables) and since is not None and since == self.checkpoint_base
            meta = {"kind": "delta", "base": since} if delta else {"kind": "full"}
            out = self.writer.start(directory, name, self._part_state(delta), core.step, meta)
            if "error" not in out:  # (the writer holds its snapshot: count the changes from here)
                core.tables.snapshot_taken()
                self.checkpoint_base = tag
                if self.incremental:
                    self._clearing = asyncio.get_running_loop().run_in_executor(None, core.tables.clear_spare_marks)
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
            part = self.core.tables[table["name"]]
            chains = []
            for files in table["chains"]:
                for path, nbytes, sha in files:
                    if path not in opened:
                        opened[path] = await loop.run_in_executor(None, read_part_file, path, nbytes, sha, False)
                chains.append([unpack_state(opened[path]["tables"][table["name"]]) for path, _, _ in files])
            with self.waits.lock:
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

        server: Any = self.control.data_plane
        if server is None:
            ctx = server_ssl_context(tls) if tls else None
            server = ShardServer(self, asyncio.get_running_loop(), secret, host=host, ssl_context=ctx,
                                 timeout=max(self.waits.barrier_timeout_s, 60.0) + 60.0, wire_dtype=wire_dtype,
                                 share_params=share_params)
            self.control.data_plane = server  # (the lease closes it when it runs out)
        return server.host, server.port

    async def close_data_plane(self) -> dict[str, int]:
        """Stop serving; returns how many replica connections it served, how many of them through
        shared memory, and how many of those read the parameters in place."""
        server: Any = self.control.data_plane
        if server is None:
            return {"connections": 0, "shared_memory": 0, "in_place": 0}
        server.close()
        self.control.data_plane = None
        return {"connections": server.connections, "shared_memory": server.shared_connections,
                "in_place": server.in_place_connections}

    def __del__(self) -> None:
        control = getattr(self, "control", None)
        for owned in (control.data_plane if control is not None else None, getattr(self, "writer", None)):
            if owned is not None:
                owned.close()

