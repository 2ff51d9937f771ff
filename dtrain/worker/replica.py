"""A training replica: the torch step and the loop that talks to the ps shards.

Nothing here imports Dask. The loop receives one *shard handle* per shard: any object whose
``push_pull`` / ``push_sync`` / ``pull`` methods return a future with ``.result(timeout=...)``
(a Dask actor handle is one; tests may pass others). The math — forward, loss, backward — knows
nothing of shards: :class:`ReplicaModel` owns the model, its persistent shard-shaped buffers and
the replica's deterministic slice of the data. Everything the replica reads of the pipeline comes
in its job description (:class:`dtrain.plan.job.ReplicaJob`), never the spec or the plan.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import torch

from dtrain.data.sources import Dataset, load_dataset, to_tensors
from dtrain.errors import OutOfRange, Unavailable  # Unavailable: a transient error, the session recovers
from dtrain.model.build import build_model
from dtrain.model.layers import get_loss
from dtrain.model.metrics import AucHistogram
from dtrain.model.tables import tables_of
from dtrain.observe.meters import Every
from dtrain.plan.job import MemoryDataset, ReplicaJob, memory_dataset
from dtrain.plan.layout import BoundModel
from dtrain.spec.device import DeviceSpec
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.buckets import GradBuckets
from dtrain.worker.inputs import MemoryBatches, Reader, StreamBatches
from dtrain.worker.tables import SparseRouter

logger = logging.getLogger(__name__)


class ShardHandle(Protocol):  # pragma: no cover - a typing aid
    def push_pull(self, *args: Any, **kwargs: Any) -> Any: ...
    def push_sync(self, *args: Any, **kwargs: Any) -> Any: ...
    def pull(self, *args: Any, **kwargs: Any) -> Any: ...


class ReplicaError(RuntimeError):
    """A replica could not go on (device missing, ps unreachable, a barrier timed out)."""


class Abandoned(RuntimeError):
    """Nobody wants the replica's result any more (its chief is gone, or cancelled it): it stopped."""


WAIT_SLICE_S = 1.0  # with ``abandoned``: how often a replica waiting for a ps reply asks it


@lru_cache(maxsize=4)
def load_memory(args: MemoryDataset) -> Dataset:
    """An in-memory dataset (cached per process by its loading arguments: the replicas and the
    session of one process load it once)."""
    return load_dataset(args.source, base_dir=args.base_dir, target=args.target, test_fraction=args.test_fraction,
                        standardize=args.standardize, seed=args.seed, task=args.task, num_samples=args.num_samples,
                        num_features=args.num_features, num_classes=args.num_classes, id_rows=args.id_rows,
                        eval_source=args.eval_source)


def dataset_for(spec: PipelineSpec) -> Dataset:
    """The pipeline's in-memory dataset (:func:`load_memory`), as a replica of it loads it (the chief's
    evaluation, its checks, the tests)."""
    return load_memory(memory_dataset(spec))


def torch_device(device: str, soft: bool) -> torch.device:
    """A plan device string -> the torch device this process computes on (soft placement)."""
    spec = DeviceSpec.from_string(device)
    if spec.device_type == "GPU":
        index = spec.device_index or 0
        if torch.cuda.is_available() and index < torch.cuda.device_count():
            return torch.device("cuda", index)
        if not soft:
            raise ReplicaError(f"{device} is placed on a GPU but this worker has "
                               f"{torch.cuda.device_count()} CUDA device(s); set placement.soft: true to fall "
                               "back to the CPU")
        logger.warning("%s: no CUDA device here; computing on the CPU (placement.soft)", device)
    return torch.device("cpu")


@dataclass
class ReplicaStats:
    replica: int
    local_steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0  # on the ps: round trips, barriers, the staleness gate, checkpoint holds
    data_s: float = 0.0  # for the next batch
    wall_s: float = 0.0
    bytes_sent: int = 0  # gradient payload pushed
    bytes_recv: int = 0  # parameter payload pulled
    device: str = "cpu"
    final_step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# A replica's telemetry counters (docs/observability.md) and the ReplicaStats field of each.
COUNTERS = {"steps": "local_steps", "samples": "samples", "compute_s": "compute_s", "data_s": "data_s",
            "ps_s": "wait_s", "wall_s": "wall_s", "bytes_sent": "bytes_sent", "bytes_recv": "bytes_recv"}


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The telemetry counters of a replica's stats (``vars(ReplicaStats)`` or the task's result)."""
    return {k: stats.get(f, 0) for k, f in COUNTERS.items()}


class StepModel(Protocol):  # pragma: no cover - a typing aid
    """What the training loop (:func:`_train`) drives: a :class:`ReplicaModel`, or a pipeline
    stage's ``dtrain.worker.stages.StageModel`` (which imports this module, so it is named here by
    its interface)."""

    device: torch.device
    model: torch.nn.Module
    bound: BoundModel
    zero_copy: bool
    grad_bufs: list[list[torch.Tensor]]
    batches: MemoryBatches | StreamBatches

    def step(self, grads: list[torch.Tensor]) -> tuple[float, int]: ...

    def peek_inputs(self) -> torch.Tensor | None: ...

    def load(self, buffers: list[torch.Tensor]) -> None: ...


class ReplicaModel:
    """The replica's model, data slice, loss and persistent buffers (as its job describes them)."""

    def __init__(self, job: ReplicaJob, device: torch.device | None = None, start_local_step: int = 0,
                 owns_replies: bool = False, read: Reader | None = None):
        settings = job.settings
        torch.set_num_threads(settings.torch_threads)
        self.job = job
        self.index = index = job.index
        self.device = device or torch_device(job.device, settings.soft_placement)
        self.model = build_model(job, device=self.device, seed=settings.seed, gathered_tables=bool(job.tables))
        self.model.train()
        self.loss_fn = get_loss(job.model.loss)
        self.bound = BoundModel(self.model, job.shard_layout())
        # Zero-copy needs reply buffers that stay ours until the next reply (the socket data
        # plane's); Dask's replies may share memory with the ps in an in-process cluster.
        self.zero_copy = self.bound.zero_copy and owns_replies
        # Parameter buffers received from the shards are copied in; gradients go out through two
        # alternating shard-shaped buffer sets (one may still be on the wire while the next fills).
        self.grad_bufs = [self.bound.new_buffers(), self.bound.new_buffers()]
        self.batches: MemoryBatches | StreamBatches = batches_of(job, self.device, start_local_step, read)
        # Batches drawn ahead (sparse tables: their ids pick the rows replies bring), each with the
        # data position after it (what a step that consumes it has read: resume points).
        self._peeked: deque[tuple[Any, int]] = deque()
        self.position = self.batches.position  # batches consumed by steps (skipped empty ones count)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        # Dropout differs per replica, reproducibly (and per resume point).
        torch.manual_seed(settings.seed * 1_000_003 + index * 7919 + start_local_step)

    def step(self, grads: list[torch.Tensor]) -> tuple[float, int]:
        """Forward, loss, backward on the next batch; the gradient ends up in ``grads`` (shard-shaped
        buffers): written there directly by backward when zero-copy is on, else copied.
        OutOfRange once the replica has read its data ``data.epochs`` times."""
        if self._peeked:
            (xb, yb), self.position = self._peeked.popleft()
        else:
            xb, yb = self.batches.next()
            self.position = self.batches.position
        if self.zero_copy:
            self.bound.grads_as_views(grads)
        else:
            for p in self.model.parameters():
                assert p.grad is not None  # bound to the gradient buffers (ReplicaModel.__init__)
                p.grad.zero_()
        loss = microbatched(self.model, self.loss_fn, xb, yb, self.job.settings.microbatches)
        if not self.zero_copy:
            self.bound.grads_into(grads)
        return loss, len(yb)

    def peek_inputs(self, ahead: int = 0) -> torch.Tensor | None:
        """The inputs of the batch ``ahead`` batches after the next (0: the next), drawn ahead (their
        ids pick the rows replies bring); None past the end of the data."""
        while len(self._peeked) <= ahead:
            try:
                batch = self.batches.next()
            except OutOfRange:
                return None
            self._peeked.append((batch, self.batches.position))
        return self._peeked[ahead][0][0]

    def load(self, buffers: list[torch.Tensor]) -> None:
        """Take the parameters of a reply: as views (zero-copy: the buffers are ours until the next
        reply to this replica) or by copying into the model."""
        for s, buf in enumerate(buffers):
            if self.zero_copy:
                self.bound.params_as_views(s, buf)
            else:
                self.bound.load_params(s, buf)


def batches_of(job: ReplicaJob, device: torch.device, start_local_step: int = 0,
               read: Reader | None = None) -> MemoryBatches | StreamBatches:
    """The batches of the job's data slice: its shards of a sharded dataset, streamed, or its slice
    of the in-memory dataset."""
    data = job.data
    assert data is not None  # (a replica, or a pipeline's first stage, reads data)
    if data.stream is not None:
        return StreamBatches(job, device, start_local_step, read)
    assert data.memory is not None
    dataset = load_memory(data.memory)
    x, y = to_tensors(dataset.x_train, dataset.y_train, device)
    return MemoryBatches(x, y, job, start_local_step)


def microbatched(model: Callable[[torch.Tensor], torch.Tensor], loss_fn: Callable[..., torch.Tensor],
                 x: torch.Tensor, y: torch.Tensor, microbatches: int) -> float:
    """Forward and backward of a batch in ``microbatches`` parts (gradient accumulation): each
    part's mean loss weighted by its share of the batch, so the gradients and the returned loss
    are the whole batch's mean. The labels follow the output to its device (a model whose last
    layers sit on another device: pipeline stages in one task)."""
    if microbatches <= 1:
        out = model(x)
        loss = loss_fn(out, y.to(out.device))
        loss.backward()
        return float(loss.detach())
    total = 0.0
    for xb, yb in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True):
        if len(yb):
            out = model(xb)
            loss = loss_fn(out, yb.to(out.device)) * (len(yb) / len(y))
            loss.backward()
            total += float(loss.detach())
    return total


def pin_compute_thread(local_rank: int, threads: int) -> list[int]:
    """Pin the calling thread (a replica's compute thread) to ``threads`` of the CPUs this process
    may use: the ``local_rank``-th group, wrapping around (``training.pin_cpus``; Linux only, the
    caller checks). Returns the CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = sorted({allowed[(local_rank * threads + j) % len(allowed)] for j in range(threads)})
    os.sched_setaffinity(0, cpus)  # pid 0: the calling thread only (Linux)
    return cpus


def run_replica(job: ReplicaJob, shards: list[Any] | Callable[[], list[Any]], *,
                start_local_step: int = 0, owns_replies: bool = False, local_rank: int | None = None,
                read: Reader | None = None, report: Callable[[dict[str, Any]], None] | None = None,
                abandoned: Callable[[], bool] | None = None) -> ReplicaStats:
    """Train replica ``job.index`` until the ps says stop. Returns its own counters. ``shards``: the
    handles (one per ``job.shards``, in order),
    or a function that opens them, called once the model is built and the data loaded (socket
    connections then do not sit idle through a slow start). ``owns_replies``: the
    handles' reply buffers stay valid until their next reply (enables zero-copy). ``local_rank``:
    this replica's rank among the replicas on its machine; with ``training.pin_cpus`` its compute
    thread is pinned to CPUs chosen by it (the affinity is restored when the replica ends). ``read``:
    how a shard of a sharded dataset is read (default: its file). ``report``: given the replica's
    counters every ``observe.interval_s / 2`` seconds and at its end (telemetry). The replica also ends, before the
    ps says stop, at the end of its data (``data.epochs``: TensorFlow's OutOfRange). ``abandoned``: asked
    before every step and every second of a wait for the ps; when it says so, the replica stops
    (:class:`Abandoned`: its chief is gone, and nobody would read its result)."""
    if not (job.settings.pin_cpus and local_rank is not None and hasattr(os, "sched_getaffinity")):
        return _run_replica(job, shards, start_local_step, owns_replies, read, report, abandoned)
    before = os.sched_getaffinity(0)
    cpus = pin_compute_thread(local_rank, job.settings.torch_threads)
    try:
        stats = _run_replica(job, shards, start_local_step, owns_replies, read, report, abandoned)
        stats.extra["cpus"] = cpus
        return stats
    finally:
        os.sched_setaffinity(0, before)


def _run_replica(job: ReplicaJob, shards: list[Any] | Callable[[], list[Any]], start_local_step: int,
                 owns_replies: bool, read: Reader | None = None, report: Callable[[dict[str, Any]], None] | None = None,
                 abandoned: Callable[[], bool] | None = None) -> ReplicaStats:
    rep = ReplicaModel(job, start_local_step=start_local_step, owns_replies=owns_replies, read=read)
    try:
        return _train(rep, job, shards, start_local_step, report, abandoned)
    finally:
        rep.batches.close()


def _train(rep: StepModel, job: ReplicaJob, shards: list[Any] | Callable[[], list[Any]], start_local_step: int,
           report: Callable[[dict[str, Any]], None] | None = None,
           abandoned: Callable[[], bool] | None = None) -> ReplicaStats:
    index, tables, t = job.index, job.tables, job.settings
    stats = ReplicaStats(index, device=str(rep.device))
    if rep.peek_inputs() is None:  # resumed at the end of its data: nothing left to do
        stats.extra["data"] = rep.batches.info()
        return stats
    if callable(shards):
        shards = shards()
    slots = [getattr(sh, "grad_slots", lambda: None)() for sh in shards]
    if rep.zero_copy and all(s is not None for s in slots):
        # Shared-memory data plane: backward writes each gradient straight into the ps's slots.
        rep.grad_bufs = [[s[j] for s in slots if s is not None] for j in range(2)]
    buckets = None
    if t.bucket_mb and rep.zero_copy and t.microbatches == 1:  # (not mid-accumulation)
        buckets = GradBuckets(rep.bound, shards, max(1, int(t.bucket_mb * 2**20 / 4)))
        if not buckets.active:  # no shard's bytes cross a socket
            buckets.remove()
            buckets = None
    timeout = t.wait_timeout_s
    t_start = time.perf_counter()
    every = Every(report, t.interval_s / 2) if report is not None else None
    step_bytes = sum(g.numel() * g.element_size() for g in rep.grad_bufs[0])  # each way, every step

    def live() -> dict[str, Any]:
        """The counters so far (the replica's report to the chief: docs/observability.md)."""
        return {"replica": index, **counters({**vars(stats), "wall_s": time.perf_counter() - t_start})}

    def check() -> None:
        if abandoned is not None and abandoned():
            raise Abandoned(f"replica {index}: its chief is gone (or cancelled it): stopped")

    def wait(futures: list[Any]) -> list[tuple[torch.Tensor, int, bool, int]]:
        t0 = time.perf_counter()
        try:
            out = [f.result(timeout=timeout) if abandoned is None else _result(f, timeout, check)
                   for f in futures]
        except (TimeoutError, FutureTimeout):  # distinct classes on Python 3.10
            raise Unavailable(f"replica {index}: a ps call got no answer in {timeout:.0f} s "
                              "(training.call_timeout_s); is a ps task lost?") from None
        stats.wait_s += time.perf_counter() - t0
        return out

    # A pipeline's later stages end when the first stage says so (their shards never stop by themselves).
    follows = getattr(rep, "follows", False)

    def said_stop(replies: list[tuple[Any, ...]]) -> bool:
        return not follows and any(r[2] for r in replies)

    router = SparseRouter(rep.model, tables, len(shards), rep.device, record=job.model.module is not None) \
        if tables else None

    def sparse(s: int, with_grads: bool = True, _cache: dict = {}) -> dict[str, Any]:  # noqa: B006
        """The ``sparse`` keyword of shard ``s``'s request (none without tables)."""
        if router is None:
            return {}
        if s == 0 or "requests" not in _cache:
            _cache["requests"] = router.requests(with_grads)
        block = _cache["requests"][s]
        return {"sparse": block} if block else {}

    def repull(s: int, with_grads: bool = True) -> dict[str, Any]:
        """The ``sparse`` keyword of a lagging shard's re-pull (:func:`_consistent`): its rows of the
        current requests (none without tables)."""
        if not sparse(s, with_grads) or router is None:
            return {}
        return {"sparse": router.requests(False)[s]}

    peek_after = rep.peek_inputs if isinstance(rep, ReplicaModel) else None  # (a stage reads one ahead)

    def route_after_next() -> None:
        """Route the batch after the next one while the ps applies the push just sent (its ids are
        the data's, not the parameters'): the next step's push then goes out without it."""
        if router is not None and peek_after is not None and len(router.pending) == 1:
            after = peek_after(1)
            if after is not None:
                router.plan_next(after)

    # Start from the shards' current parameters (all at one step: sync needs it, async is harmless).
    if router is not None:
        first = rep.peek_inputs()
        assert first is not None  # the first batch (a replica's data is never empty: checked before start)
        router.plan_next(first)
    replies = wait([s.pull(0, **sparse(i, False)) for i, s in enumerate(shards)])
    version = replies[0][1]
    if t.mode == "sync":
        replies, version = _consistent(replies, shards, wait, lambda i: repull(i, False))
    if router is not None and not any(r[2] for r in replies):
        router.take(replies)
    rep.load([r[0] for r in replies])
    versions = [r[1] for r in replies]
    stop = said_stop(replies)
    pending: list[Any] | None = None
    overlap = t.overlap  # default: on in async mode without tables (TrainingSpec.overlaps)
    k = start_local_step
    while not stop:
        check()
        t_data = time.perf_counter()
        if rep.peek_inputs() is None:  # OutOfRange: the replica has read its data data.epochs times
            break
        t0 = time.perf_counter()
        stats.data_s += t0 - t_data
        if every is not None:
            every.tick(t0, live)
        grads = rep.grad_bufs[k % 2]
        if buckets is not None:
            buckets.begin(grads)
        loss, n = rep.step(grads)
        heads = buckets.end() if buckets is not None else None
        stats.compute_s += time.perf_counter() - t0
        stats.local_steps += 1
        stats.samples += n
        stats.bytes_sent += step_bytes
        stats.bytes_recv += step_bytes
        k = rep.position if isinstance(rep, ReplicaModel) else rep.batches.position  # batches taken (skipped empty ones count)
        if router is not None and not router.pending and (ahead := rep.peek_inputs()) is not None:
            router.plan_next(ahead)  # (the first step's: the later ones are routed while the ps applies)
        if t.mode == "sync":
            futs = [sh.push_sync(grads[s], index, version, loss if s == 0 else None, n if s == 0 else 0, k,
                                 **_head(heads, s), **sparse(s)) for s, sh in enumerate(shards)]
            route_after_next()
            replies, version = _consistent(wait(futs), shards, wait, repull)
            rep.load([r[0] for r in replies])
            stop = said_stop(replies)
            if router is not None and not stop:
                router.take(replies)
            continue
        if overlap and pending is not None:
            # Staleness 1: this step's gradient was computed while the previous push was in flight.
            replies = wait(pending)
            rep.load([r[0] for r in replies])
            versions = [r[1] for r in replies]
            pending = None
            if stop := said_stop(replies):  # this step's gradient would only be answered "stop": not pushed
                stats.local_steps, stats.samples = stats.local_steps - 1, stats.samples - n
                stats.bytes_sent, stats.bytes_recv = stats.bytes_sent - step_bytes, stats.bytes_recv - step_bytes
                break
        futs = [sh.push_pull(grads[s], index, versions[s], loss if s == 0 else None, n if s == 0 else 0, k,
                             **_head(heads, s), **sparse(s)) for s, sh in enumerate(shards)]
        if overlap:
            pending = futs
            continue
        route_after_next()
        replies = wait(futs)
        rep.load([r[0] for r in replies])
        versions = [r[1] for r in replies]
        stop = said_stop(replies)
        if router is not None and not stop:
            router.take(replies)
    if pending is not None:
        replies = wait(pending)
        versions = [r[1] for r in replies]
    if buckets is not None:
        stats.extra["parts_sent"] = buckets.parts_sent
        buckets.remove()
    if router is not None:
        stats.extra["rows_received"] = router.rows_moved
    stats.extra["data"] = rep.batches.info()
    stats.final_step = versions[0] if t.mode == "async" else version
    stats.wall_s = time.perf_counter() - t_start
    if report is not None:
        report(live())  # the last figures, before the chief collects the replica's result
    if index == 0:
        stats.extra["buffers"] = model_buffers(rep.model)
    return stats


def _result(future: Any, timeout: float, check: Callable[[], None]) -> Any:
    """``future.result(timeout=timeout)``, calling ``check`` every :data:`WAIT_SLICE_S` of the wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(min(WAIT_SLICE_S, deadline - time.monotonic()), 0.0))
        except (TimeoutError, FutureTimeout):
            if time.monotonic() >= deadline:
                raise
            check()


def _head(heads: list[int | None] | None, s: int) -> dict[str, int]:
    """The ``head`` keyword for shard ``s``'s push when buckets already went (else no keyword:
    the actor path's methods do not take it)."""
    head = heads[s] if heads is not None else None
    return {"head": head} if head is not None else {}


def _consistent(replies: list[tuple[Any, ...]], shards: list[Any], wait: Any,
                extra: Callable[[int], dict[str, Any]] = lambda s: {}) -> tuple[list[tuple[Any, ...]], int]:
    """Sync needs every shard's parameters from one step: re-pull lagging shards until they agree.

    (A replica never computes on parameters taken from two different steps of two shards.)
    """
    replies = list(replies)
    for _ in range(100):
        steps = [r[1] for r in replies]
        target = max(steps)
        if min(steps) == target or any(r[2] for r in replies):
            return replies, target
        lagging = [s for s, st in enumerate(steps) if st < target]
        for s, reply in zip(lagging, wait([shards[s].pull(target, **(extra(s) or {})) for s in lagging]), strict=True):
            replies[s] = reply
    raise ReplicaError("shards did not converge on one step after 100 pulls")


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_name: str,
             batch_size: int = 1024, auc: AucHistogram | None = None) -> dict[str, float]:
    """Mean loss (and accuracy for classification) of ``model`` on (x, y), in eval mode; ``auc``
    (binary labels) accumulates the logits' ROC curve."""
    from dtrain.model.layers import accuracy, is_classification

    if len(x) == 0:
        return {}
    was_training = model.training
    model.eval()
    loss_fn = get_loss(loss_name)
    total, correct = 0.0, 0.0
    try:
        for i in range(0, len(x), batch_size):
            out = model(x[i:i + batch_size])
            yb = y[i:i + batch_size]
            total += float(loss_fn(out, yb)) * len(yb)
            if is_classification(loss_name):
                correct += accuracy(out, yb, loss_name) * len(yb)
            if auc is not None:
                auc.add(out, yb)
    finally:
        model.train(was_training)
    result = {"loss": total / len(x)}
    if is_classification(loss_name):
        result["accuracy"] = correct / len(x)
    return result


def model_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Non-parameter state (BatchNorm running statistics), as a plain dict of CPU tensors; not the
    tables' (a replica's gathered table holds no rows: the ps tasks have them)."""
    tables = {name.removesuffix("weight") for name, _ in tables_of(model)}
    return {name: b.detach().cpu().clone() for name, b in model.named_buffers()
            if not any(name.startswith(t) for t in tables)}
