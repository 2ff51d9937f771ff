"""The chief's side of the ps: every call it makes to the ParameterShard actors, in one place.

A :class:`ShardGroup` creates one actor per shard (pinned to its task's worker address), opens
their data plane, restores them from a checkpoint, reads progress, and moves all of them
together: a consistent hold (every shard paused at one step, for a snapshot or a stop), release,
stop, and the state a checkpoint needs. Each call has a timeout; a shard that does not answer
raises, and the session's recovery decides whether a task was lost.

While the group lives, a background thread renews every shard's lease (``ParameterShard.renew``)
every quarter lease: a thread rather than the monitor loop, so a long evaluation, checkpoint or
recovery never lets a lease lapse, while a dead chief (SIGKILL, OOM, a lost machine) stops its
shards and frees their data planes within one lease (``lease_seconds``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from distributed import Future

from dtrain.chief.checkpoint import Checkpoint, part_chain
from dtrain.deploy.cluster import Connection
from dtrain.errors import RunError
from dtrain.plan.assign import task_host
from dtrain.plan.compiler import Plan, parameter_layout
from dtrain.plan.layout import ShardLayout, reshard
from dtrain.plan.tables import (
    table_config,
    table_layout,
)
from dtrain.ps.part_writer import part_name, read_part_file, written_report
from dtrain.ps.rows import pack_state
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.tasks import WorkerShard

from . import tables
from .calls import call, calls, transfer_timeout

logger = logging.getLogger(__name__)


def lease_seconds(spec: PipelineSpec) -> float:
    """How long a shard outlives its chief's last renewal: ``cluster.lease_s``, or by default well
    past anything the chief waits for (a worker-ttl to declare a task lost, several times over),
    and at least a minute."""
    if spec.cluster.lease_s is not None:
        return spec.cluster.lease_s
    return max(60.0, 4.0 * spec.cluster.worker_ttl_s)


class ShardGroup:
    """The ps actors of one generation of a run (see the module docstring)."""

    def __init__(self, conn: Connection, spec: PipelineSpec, plan: Plan, token: str, nan_guard: bool = False,
                 lease_s: float | None = None):
        self.conn = conn
        self.client = conn.client
        self.spec = spec
        self.plan = plan  # replaced by the session after a recovery (new worker addresses)
        self.token = token
        self.nan_guard = nan_guard
        self.generation = 0
        self.handles: list[Any] = []
        self.futures: list[Future] = []
        self.data_plane: dict[str, Any] | None = None
        self._secret = secrets.token_bytes(32)
        self.last_step = spec.training.steps  # lowered by a stop_at_step hook (stop_at)
        # Replica connections the ps data planes served (all generations), and through shared memory.
        self.data_plane_counts = {"connections": 0, "shared_memory_connections": 0, "in_place_connections": 0}
        self.lease_s = lease_s or lease_seconds(spec)
        # A TLS cluster (cluster.security, a TLS client, the embedded cluster) never gets a
        # plaintext data plane (review M2).
        self.tls = str(self.client.scheduler.address).startswith("tls://") if self.client is not None else False
        self._renewing = threading.Event()  # set: stop renewing
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ creation
    def _config(self, index: int) -> dict[str, Any]:
        t = self.spec.training
        return {
            "index": index, "mode": t.mode, "steps": self.last_step, "generation": self.generation,
            "holds_global_step": self.plan.shards[index].holds_global_step,
            "barrier_timeout_s": t.barrier_timeout_s, "summary_every": self.spec.summary.every_steps,
            "nan_guard": self.nan_guard,
            "num_replicas": self.plan.num_replicas, "replicas_to_aggregate": self.plan.replicas_to_aggregate,
            "aggregate_fraction": self.plan.aggregate_fraction,
            "sync_tokens": t.sync_tokens, "init_tokens": t.init_tokens,  # TF's token queue (ps/tokens.py)
            "max_staleness": t.max_staleness, "optimizer": self.spec.optimizer.model_dump(),
            "torch_threads": t.torch_threads,
            "moving_average": t.moving_average.model_dump() if t.moving_average is not None else None,
            "checkpoint_every": self.spec.checkpoint.every_steps if self.spec.checkpoint is not None else None,
            "incremental": self.spec.checkpoint is not None and self.spec.checkpoint.incremental is not None,
            "lease_s": self.lease_s, "tls": self.tls, "telemetry": self.spec.observe.telemetry,
            # Sparse tables: this ps task's part of each (the ps tasks are the first shards).
            "tables": [table_config(t, index, self.spec.training.seed) for t in self.plan.tables
                       if index < len(t.parts)],
        }

    def create(self, init: list[torch.Tensor]) -> None:
        """One actor per shard, pinned to its task's worker address, initialised with ``init``."""
        self.handles, self.futures = [], []
        for shard, values in zip(self.plan.shards, init, strict=True):
            addr = self.conn.tasks[shard.task]
            data = self.client.scatter(values, workers=[addr], direct=True, hash=False)
            fut = self.client.submit(WorkerShard, self._config(shard.index), data, actor=True,
                                     workers=[addr], allow_other_workers=False, pure=False,
                                     key=f"dtrain-ps-{shard.index}-g{self.generation}-{self.token}")
            self.futures.append(fut)
        self.handles = [f.result(timeout=self.spec.cluster.wait_s) for f in self.futures]
        self.renew()
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="dtrain-lease", daemon=True)
            self._renewer.start()
        self.data_plane = None
        if self.spec.training.transport == "socket" and self.spec.training.replication == "between_graph":
            self.data_plane = self._open_data_plane()

    def _open_data_plane(self) -> dict[str, Any]:
        """Each ps actor opens a listener on its worker's host; replicas get the endpoints and a
        per-run secret through Dask (the control plane: TLS-protected when the cluster is). On a
        TLS cluster the data plane is TLS too, each ps and replica with its own worker's
        certificate (``WorkerShard``): no private key leaves its machine."""
        tls = True if self.tls else None  # each process uses its own worker's certificate
        wire = self.spec.training.wire_dtype
        share = self.spec.training.shared_memory
        endpoints = [tuple(call(handle.open_data_plane(self._secret, task_host(self.conn.tasks[shard.task]), tls, wire,
                                                       share)))
                     for shard, handle in zip(self.plan.shards, self.handles, strict=True)]
        return {"endpoints": endpoints, "secret": self._secret, "tls": tls, "wire_dtype": wire,
                "shared_memory": share}

    def close_data_plane(self) -> None:
        if self.data_plane is None:
            return
        counts = self.data_plane_counts
        for s in self.handles:
            try:
                served = call(s.close_data_plane(), timeout=5)
                counts["connections"] += served["connections"]
                counts["shared_memory_connections"] += served["shared_memory"]
                counts["in_place_connections"] += served["in_place"]
            except Exception as exc:  # a lost shard's listener died with its process
                logger.debug("close_data_plane failed: %s", exc)
        self.data_plane = None

    def restore(self, checkpoint: Checkpoint) -> bool:
        """Set every shard (params, optimizer state, step) from one checkpoint: as written when the
        placement is the same, else resharded (another number of ps tasks or another placement:
        each variable and its optimizer state reassembled and placed anew). A checkpoint of other
        variables (names, shapes) or another optimizer is refused with a RunError saying what
        differs. Returns whether each ps task restored its own part (the same placement).

        A checkpoint of parts is read by the ps tasks: on the same placement each reads and checks
        its own part's chain; on another, each file is checked once by one task, the chief reshards
        the dense state (reading only that of each part, memory-mapped) and each task reads, from
        every old part, only the table rows it owns now (``ParameterShard.load_resharded``). A
        checkpoint of the single-file format is assembled and resharded here."""
        _check_restorable(checkpoint, self.spec)
        if checkpoint.payload.get("pipeline_hash") not in (None, self.plan.pipeline_hash):
            logger.info("%s was written by another version of this pipeline (its variables and optimizer "
                        "match; settings such as the learning rate or steps may differ)", checkpoint.path.name)
        if checkpoint.parts is not None:
            return self._restore_parts(checkpoint)
        states = list(checkpoint.payload["shards"])
        written = checkpoint.payload.get("layout") or {}
        layout = ShardLayout.from_plan(self.plan)
        if written.get("parts"):
            old = ShardLayout.from_description(written)
            if not old.same_as(layout):
                logger.info("%s: resharding %d shard(s) onto %d", checkpoint.path.name, old.num_shards,
                            layout.num_shards)
                states = reshard(states, old, layout)
        states = tables.restore_tables(self.plan, checkpoint, states, written)
        if len(states) != len(self.handles) or any(
                st["params"].numel() != s.numel for st, s in zip(states, self.plan.shards, strict=True)):
            raise RunError(f"{checkpoint.path} was written for a different model or placement "
                           f"({len(states)} shard(s)); use another --run-dir")
        for shard, state in zip(self.handles, states, strict=True):
            packed = {n: pack_state(t) for n, t in (state.get("tables") or {}).items()}  # bfloat16 rows: int16 bits
            call(shard.set_state({**state, "tables": packed} if packed else state),
                 timeout=transfer_timeout(state["params"].numel()))
        return False

    def _restore_parts(self, checkpoint: Checkpoint) -> bool:
        """A checkpoint of parts: written for this very placement, each ps task reads and verifies
        its own part's chain (``ParameterShard.load_part``; True); else :meth:`_reshard_parts`
        (False). Nothing of the tables passes through the chief."""
        parts = sorted(checkpoint.parts or (), key=lambda p: int(p["shard"]))
        written = checkpoint.payload.get("layout") or {}
        chains = [[(str(path), nbytes, sha) for path, nbytes, sha in part_chain(checkpoint.path, p)] for p in parts]
        layout = ShardLayout.from_plan(self.plan)
        old = ShardLayout.from_description(written) if written.get("parts") else layout
        if not (len(parts) == len(self.handles) and old.same_as(layout)
                and table_layout(self.plan.tables) == (written.get("tables") or [])):
            self._reshard_parts(checkpoint, chains, old, layout)
            return False
        futures = [s.load_part(chain, checkpoint.step) for s, chain in zip(self.handles, chains, strict=True)]
        for f, shard in zip(futures, self.plan.shards, strict=True):
            call(f, timeout=transfer_timeout(shard.numel) + 600)
        return True

    def _reshard_parts(self, checkpoint: Checkpoint, chains: list[list[tuple[str, int, str]]], old: ShardLayout,
                       layout: ShardLayout) -> None:
        """Restore a checkpoint of parts written under another placement (:meth:`restore`)."""
        recorded = tables.written_tables(self.plan, checkpoint, checkpoint.payload.get("layout") or {})
        logger.info("%s: resharding %d ps shard(s) onto %d (each ps task reads the table rows it owns)",
                    checkpoint.path.name, old.num_shards, layout.num_shards)
        files = sorted({f for chain in chains for f in chain})  # (each checked once, the tasks in parallel)
        futures = [h.check_files(files[j::len(self.handles)]) for j, h in enumerate(self.handles)]
        for f in futures:
            call(f, timeout=3600)
        dense = []
        for chain in chains:  # (the newest file of each chain holds its shard's dense state whole)
            state = read_part_file(*chain[-1], verify=False)  # (memory-mapped: the tables are not read)
            dense.append({k: v for k, v in state.items() if k not in ("tables", "part_format")})
        if not old.same_as(layout):
            dense = reshard(dense, old, layout)
        if len(dense) != len(self.handles) or any(
                st["params"].numel() != s.numel for st, s in zip(dense, self.plan.shards, strict=True)):
            raise RunError(f"{checkpoint.path} was written for a different model or placement "
                           f"({len(dense)} shard(s)); use another --run-dir")
        recipes = tables.reshard_recipes(self.plan, recorded, chains)
        futures = [h.load_resharded(state, recipes.get(j, []))
                   for j, (h, state) in enumerate(zip(self.handles, dense, strict=True))]
        for f, shard in zip(futures, self.plan.shards, strict=True):
            call(f, timeout=transfer_timeout(shard.numel) + 3600)

    def refs(self) -> list[tuple[str, str]]:
        """``(worker address, actor key)`` per shard: replicas rebuild their handles from these."""
        return [(self.conn.tasks[s.task], f.key) for s, f in zip(self.plan.shards, self.futures, strict=True)]

    # ------------------------------------------------------------------ the chief's lease
    def renew(self) -> None:
        """Renew every shard's lease (a lost shard is the monitor's business, not this call's)."""
        for s in list(self.handles):
            try:
                call(s.renew(), timeout=min(10.0, self.lease_s / 4))
            except Exception as exc:
                logger.warning("renewing a ps shard's lease failed: %s", exc)

    def _renew_loop(self) -> None:
        with self.client.as_current():  # actor handles bind to the current client
            while not self._renewing.wait(self.lease_s / 4):
                self.renew()

    def stop_renewing(self) -> None:
        """The run is over: let the leases lapse (a shard left on a worker then frees itself)."""
        self._renewing.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=15)
        self._renewer = None

    # ------------------------------------------------------------------ reads
    def stats(self, timeout: float = 10) -> dict[str, Any]:
        """Shard 0's progress: step, records, errors, local steps (drains its records)."""
        return call(self.handles[0].stats(), timeout=timeout)

    def loads(self, timeout: float = 5) -> dict[int, dict[str, Any]]:
        """Every shard's telemetry (``ParameterShard.load``), asked of all at once; a shard that
        does not answer in ``timeout`` is left out (recovery notices a lost ps, not telemetry)."""
        futures = calls(self.handles, "load")
        out = {}
        for j, f in enumerate(futures):
            try:
                value = call(f, timeout=timeout)
            except Exception:
                continue
            if value is not None:
                out[j] = value
        return out

    def pull_params(self, for_eval: bool = False) -> list[torch.Tensor]:
        """Every shard's parameters; ``for_eval`` (evaluation, model.pt): their moving averages when
        ``training.moving_average.use_for_eval`` (ps/averages.py)."""
        ema = self.spec.training.moving_average
        averaged = for_eval and ema is not None and ema.use_for_eval
        return [call(s.get_params(averaged), timeout=transfer_timeout(shard.numel, state_factor=1))[0]
                for s, shard in zip(self.handles, self.plan.shards, strict=True)]

    # ---- sparse tables (dtrain.chief.tables): evaluation, model.pt, summary.json
    def gather_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return tables.gather_rows(self.handles, self.plan, name, ids)

    def pull_rows(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.pull_rows(self.handles, self.plan, name)

    def pull_table(self, name: str, chunk_rows: int = 1 << 20) -> torch.Tensor:
        return tables.pull_table(self.handles, self.plan, name, chunk_rows)

    def table_stats(self, timeout: float = 10) -> dict[str, dict[str, Any]]:
        return tables.table_stats(self.handles, self.plan, timeout)

    def steps(self, timeout: float = 5) -> list[int]:
        return [call(s.current_step(), timeout=timeout) for s in self.handles]

    # ------------------------------------------------------------------ moving all shards together
    def request_stop(self) -> None:
        for s in self.handles:
            try:
                call(s.request_stop(), timeout=10)
            except Exception as exc:  # a lost shard cannot be stopped; its replicas time out
                logger.debug("request_stop failed: %s", exc)

    def stop_at(self, step: int) -> None:
        """End training at global step ``step`` (exactly: the shards refuse the updates after it)."""
        self.last_step = min(self.last_step, step)
        for s in self.handles:
            call(s.stop_at(self.last_step))

    def hold_consistent(self) -> list[int]:
        """Pause applies with every shard at one step; returns the steps.

        Async: at once. Sync: at the newest step any shard has reached, once the lagging shards
        have applied it (they are at most one step behind, and the replicas' gradients for that
        step are already on their way)."""
        if self.spec.training.mode == "async":
            return [call(s.hold()) for s in self.handles]
        # (the steps, read without touching a hold: a shard may already be paused at a
        # checkpoint step of its own, see ShardCore.after_apply in ps/core.py)
        target = max(self.steps(timeout=30))
        steps: list[int] = []
        for _ in range(5):
            for s in self.handles:
                call(s.hold(target))
            steps = [call(s.wait_held(), timeout=self.spec.training.barrier_timeout_s + 5) for s in self.handles]
            if min(steps) == max(steps):
                break
            target = max(steps)
        return steps

    def release(self) -> None:
        for s in self.handles:
            try:
                call(s.release(), timeout=10)
            except Exception as exc:  # a lost shard: recovery will replace it
                logger.debug("release failed: %s", exc)

    def write_parts(self, directory_for: Callable[[int], Path | None], stop: bool = False,
                    since: int | None = None) -> tuple[int, Path | None]:
        """Every shard starts writing its part of a checkpoint at one consistent step (held as
        :meth:`hold_consistent` holds; with ``stop``, every shard also stops there) into
        ``directory_for(step)``, and the hold ends once each has taken its copy-on-write snapshot
        (``ParameterShard.write_part``). Returns (the step, the directory: None, and nothing written,
        when ``directory_for`` gives none: a checkpoint of that step exists); RunError when the shards
        disagree on the step or one refuses (non-finite parameters, a part still being written).
        ``since``: the checkpoint (its step) the parts may be deltas of (``checkpoint.incremental``;
        a shard that does not count its changes from that one writes a full part)."""
        try:
            steps = self.hold_consistent()
            if self.spec.training.mode == "sync" and len(set(steps)) != 1:
                raise RunError(f"the shards did not agree on one step for a checkpoint ({steps}); "
                               "no checkpoint written")
            if stop:
                self.request_stop()
            directory = directory_for(steps[0])
            if directory is None:  # (written already)
                return steps[0], None
            futures = [s.write_part(str(directory), part_name(i), steps[0], since)  # (all at once)
                       for i, s in enumerate(self.handles)]
            started = [call(f, timeout=transfer_timeout(shard.numel))
                       for f, shard in zip(futures, self.plan.shards, strict=True)]
        finally:
            self.release()
        if errors := [r["error"] for r in started if "error" in r]:
            raise RunError(f"{errors[0]}; no checkpoint written (lower optimizer.lr, check the data, or add a "
                           "nan_guard hook to stop at the first non-finite gradient)" if "non-finite" in errors[0]
                           else f"{errors[0]}; no checkpoint written")
        return int(started[0]["started"]), directory

    def parts_written(self, directory: Path, wait: bool = False, timeout: float = 3600) -> list[dict[str, Any]] | None:
        """Each shard's part in ``directory`` (``{"shard", "file", "bytes", "sha256", "kind"}``, and
        ``base`` for a delta) once all are
        written, None while one is still being written (``wait``: block until all are). A part whose
        report lies beside it is written, whether or not its task is still there; for the others the
        task is asked. RunError when a shard's writer failed."""
        out = []
        for i, s in enumerate(self.handles):
            done = written_report(directory / part_name(i))
            if done is None:
                done = call(s.part_written(wait), timeout=timeout if wait else 30)
                if done is None:
                    return None
                if "error" in done:
                    raise RunError(f"ps shard {i} could not write its part of the checkpoint of step "
                                   f"{done.get('step')}: {done['error']}")
            out.append({"shard": i, **{k: done[k] for k in ("file", "bytes", "sha256", "kind", "base") if k in done}})
        return out

    def stop_consistently(self) -> None:
        """A hook's stop: in sync mode every shard stops at the same step (held first, so no step
        lands on one shard but not another); async simply stops."""
        if self.spec.training.mode == "sync":
            try:
                self.hold_consistent()
                self.request_stop()
            finally:
                self.release()
        else:
            self.request_stop()

    # ------------------------------------------------------------------ recovery support
    def set_owners(self, owners: dict[int, int]) -> None:
        """Fencing (both transports): the submission ``attempt`` owns each replica index, so the
        ps refuses pushes from that replica's earlier attempts (a hung worker that thaws after
        its replica was resubmitted elsewhere). Set before the (re)submission."""
        futures = [f for replica, attempt in owners.items() for f in calls(self.handles, "set_owner", replica, attempt)]
        for f in futures:
            try:
                call(f, timeout=30)
            except Exception as exc:  # a shard that does not answer is handled as lost next
                logger.warning("set_owner failed (that shard does not fence these replicas): %s", exc)

    def grant_barrier_grace(self, seconds: float) -> None:
        for s in self.handles:
            try:
                call(s.barrier_grace(seconds), timeout=5)
            except Exception as exc:  # a shard that does not answer is handled as lost next
                logger.debug("barrier_grace failed: %s", exc)

    def excuse(self, lost_replicas: list[int]) -> None:
        """Sync: complete, on every shard behind the leading one, its step without the lost
        replicas' gradients (see ``ParameterShard.excuse``)."""
        try:
            steps = self.steps()
            top = max(steps)
            for s, step in zip(self.handles, steps, strict=True):
                for i in lost_replicas if step < top else []:
                    call(s.excuse(i, step), timeout=self.spec.training.barrier_timeout_s + 5)
        except Exception as exc:  # a shard that does not answer is handled as lost next
            logger.debug("excuse failed: %s", exc)

    def level(self, lost_replicas: list[int], wait_s: float = 2.0) -> list[int]:
        """Sync, once ``lost_replicas``' tasks are gone: complete the step they left half-pushed
        (:meth:`excuse`, again: a push of theirs may have landed after the first excuse) and return
        the shards' steps, as soon as they agree or after ``wait_s``. Steps that still differ are a
        step only the lost replicas' gradients could complete: a lone replica's, or a pipeline
        stage's, whose shards no other replica pushes to."""
        deadline = time.monotonic() + wait_s
        while True:
            self.excuse(lost_replicas)
            steps = self.steps()
            if len(set(steps)) == 1 or time.monotonic() >= deadline:
                return steps
            time.sleep(0.1)

    def retire(self, replicas: list[int], how: str = "retire") -> None:
        """``replicas`` read all their data (data.epochs) and ended, or left an elastic job: no
        shard waits for them again; ``how="rejoin"``: an elastic job's replicas are back (see
        ``ParameterShard.excuse``)."""
        for s in self.handles:
            for i in replicas:
                try:
                    call(s.excuse(i, None, how), timeout=self.spec.training.barrier_timeout_s + 5)
                except Exception as exc:  # a shard that does not answer is handled as lost next
                    logger.debug("retire failed: %s", exc)


def _check_restorable(checkpoint: Checkpoint, spec: PipelineSpec) -> None:
    """RunError unless the checkpoint's variables and optimizer are this pipeline's (names and
    shapes; the optimizer's name: its settings, e.g. the learning rate, may change on a resume)."""
    payload = checkpoint.payload
    name = checkpoint.path.name
    written_opt = ((payload.get("spec") or {}).get("optimizer") or {}).get("name")
    if written_opt is not None and written_opt != spec.optimizer.name:
        raise RunError(f"{name} was written with optimizer {written_opt!r}, the pipeline has "
                       f"{spec.optimizer.name!r}: its optimizer state cannot be used; resume with "
                       f"optimizer.name: {written_opt}, or start over in another --run-dir")
    written = (payload.get("layout") or {}).get("variables")
    if written:
        mine = dict(_variables(spec))
        theirs = {v: tuple(shape) for v, shape in written}
        problems = [f"{v} {list(s)} is not in the model" for v, s in theirs.items() if v not in mine]
        problems += [f"the model's {v} {list(s)} is not in the checkpoint" for v, s in mine.items() if v not in theirs]
        problems += [f"{v} is {list(theirs[v])} there and {list(s)} in the model" for v, s in mine.items()
                     if v in theirs and theirs[v] != s]
        if problems:
            raise RunError(f"{name} holds other variables than the model ({'; '.join(problems[:5])}"
                           + (f"; {len(problems) - 5} more" if len(problems) > 5 else "")
                           + "): a resume needs the same model; start over in another --run-dir")


def _variables(spec: PipelineSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter's name and shape, in creation order (from the model on the meta device)."""
    return [(name, tuple(shape)) for name, shape, _ in parameter_layout(spec)]


def checkpoint_layout(spec: PipelineSpec, plan: Plan) -> dict[str, Any]:
    """What a checkpoint records of the model and its placement, so a resume can check it and
    reshard it."""
    return {**ShardLayout.from_plan(plan).describe(), "variables": [[n, list(s)] for n, s in _variables(spec)],
            "tables": table_layout(plan.tables)}
