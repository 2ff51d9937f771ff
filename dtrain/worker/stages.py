"""One pipeline stage of a replica (model parallelism, GPipe): its layers, its shards, its links.
Nothing here imports Dask.

A replica of a model with stage pins runs as one task per stage position (``plan.stages``), each
in its own worker task's process. :class:`StageModel` has the interface of
:class:`~dtrain.worker.replica.ReplicaModel`, so the replica loop (``_train``: pulls, pushes,
sync and async, staleness) drives a stage unchanged; only the step differs:

- the **first** stage reads the batch, splits it into ``training.microbatches`` parts, runs its
  layers on each and sends the outputs (and the labels) downstream, then takes the gradients of
  those outputs as they come back and runs its backward; it decides when the pipeline stops;
- a **middle** stage receives each micro-batch, runs its layers, sends the output on, and later
  sends the gradient of its input back;
- the **last** stage computes each micro-batch's loss (weighted by its share of the batch, so
  the gradients sum to the whole batch's) and sends its input's gradient back at once.

Each stage pushes the gradients of its own layers, summed over the micro-batches, to its own
shards, and pulls only their parameters. Stages of one position on different devices run in
that process, activations moved between devices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain.dataplane.links import BACKWARD, FORWARD, STOP, Message, StageLink
from dtrain.model.build import build_model, build_model_skeleton
from dtrain.model.layers import get_loss, init_parameters
from dtrain.plan.job import ReplicaJob
from dtrain.plan.layout import BoundModel
from dtrain.worker.inputs import Reader
from dtrain.worker.replica import (
    ReplicaError,
    ReplicaStats,
    ShardHandle,
    _train,
    batches_of,
    microbatched,
    torch_device,
)

logger = logging.getLogger(__name__)


class StageError(ReplicaError):
    """A stage received what the pipeline protocol does not allow."""


class _Steps:
    """A later stage's step counter (it reads no data: the batches arrive from upstream)."""

    def __init__(self, start: int):
        self.position = start

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class StageModel:
    """A stage's layers, buffers and links, with ``ReplicaModel``'s interface (module docstring):
    stage ``job.stage.position`` of replica ``job.index``."""

    def __init__(self, job: ReplicaJob, up: StageLink | None, down: StageLink | None, start_local_step: int = 0,
                 read: Reader | None = None, owns_replies: bool = False):
        assert job.stage is not None  # a stage task's job
        settings = job.settings
        torch.set_num_threads(settings.torch_threads)
        self.job, self.index, self.position = job, job.index, job.stage.position
        index, position = self.index, self.position
        self.up, self.down = up, down
        self.follows = position > 0
        self.microbatches = settings.microbatches
        soft = settings.soft_placement
        # model.layers: only this stage's layers get memory (built on the meta device, then
        # materialised and initialised here; the ps sends their values at the first pull), so a
        # model too large for one process can be split. A model.module is built whole (its own
        # buffers need its constructor), then only this stage's children are kept.
        lean = job.model.layers is not None
        whole = build_model_skeleton(job) if lean else build_model(job, seed=settings.seed)
        children = list(whole.named_children())
        self.model = nn.Module()
        self.parts: list[tuple[torch.device, list[nn.Module]]] = []
        for device, members in job.stage.devices:
            dev = torch_device(device, soft)
            modules = []
            for m in members:
                name, child = children[m]
                child = init_parameters(child.to_empty(device=dev), settings.seed) if lean else child.to(dev)
                self.model.add_module(name, child)
                modules.append(child)
            self.parts.append((dev, modules))
        del whole
        self.device = self.parts[0][0]
        self.model.train()
        self.loss_fn = get_loss(job.model.loss)
        self.bound = BoundModel(self.model, job.shard_layout())
        # As a whole replica's (ReplicaModel): gradients written by backward straight into the
        # shard-shaped buffers, parameters as views of the replies when they stay ours.
        self.zero_copy = self.bound.zero_copy and owns_replies
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.grad_bufs = [self.bound.new_buffers(), self.bound.new_buffers()]
        self.batches: Any = _Steps(start_local_step) if position > 0 \
            else batches_of(job, self.device, start_local_step, read)
        self._peeked: Any = None
        self.stopped = False
        self.exchange_s = 0.0  # waiting for a neighbour's activations or gradients
        self.exchanges = 0
        torch.manual_seed(settings.seed * 1_000_003 + index * 7919 + position * 104_729 + start_local_step)

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for dev, modules in self.parts:
            x = x.to(dev)
            for m in modules:
                x = m(x)
        return x

    def _receive(self, link: StageLink, kind: int) -> Message:
        t0 = time.perf_counter()
        msg = link.receive()
        self.exchange_s += time.perf_counter() - t0
        self.exchanges += 1
        if msg.kind != kind:
            raise StageError(f"replica {self.index} stage {self.position}: expected a "
                             f"{'forward' if kind == FORWARD else 'backward'} message, got kind {msg.kind}")
        return msg

    def peek_inputs(self) -> torch.Tensor | None:
        """The next step's first input: a batch read (first stage) or a micro-batch received;
        None at the end (the data's end, or the first stage's STOP)."""
        if self._peeked is not None:
            return self._peeked[0]
        if self.stopped:
            return None
        if self.position == 0:
            from dtrain.errors import OutOfRange

            try:
                self._peeked = self.batches.next()
            except OutOfRange:
                return None
            return self._peeked[0]
        t0 = time.perf_counter()
        msg = self.up.receive()  # type: ignore[union-attr]
        self.exchange_s += time.perf_counter() - t0
        if msg.kind == STOP:
            self.stopped = True
            return None
        if msg.kind != FORWARD:
            raise StageError(f"replica {self.index} stage {self.position}: expected a forward message, got kind {msg.kind}")
        self._peeked = (msg.tensors[0], msg)
        return msg.tensors[0]

    def step(self, grads: list[torch.Tensor]) -> tuple[float, int]:
        """One step's forwards and backwards of this stage; its gradient ends up in ``grads``."""
        if self.peek_inputs() is None:
            raise StageError(f"replica {self.index} stage {self.position}: a step past the end")
        peeked, self._peeked = self._peeked, None
        if self.zero_copy:
            self.bound.grads_as_views(grads)
        else:
            for p in self.model.parameters():
                assert p.grad is not None  # bound to the gradient buffers (__init__)
                p.grad.zero_()
        if self.position == 0:
            loss, n = self._first(*peeked)
        else:
            loss, n = self._later(peeked[1])
        if not self.zero_copy:
            self.bound.grads_into(grads)
        if self.position > 0:
            self.batches.position += 1
        return loss, n

    def _first(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        if self.down is None:  # one stage task (stages on several devices of it): the loss here
            return microbatched(self.forward, self.loss_fn, x, y, self.microbatches), len(y)
        chunks = [(xb, yb) for xb, yb in zip(torch.tensor_split(x, self.microbatches),
                                              torch.tensor_split(y, self.microbatches), strict=True) if len(yb)]
        outs = []
        for i, (xb, yb) in enumerate(chunks):
            out = self.forward(xb)
            self.down.send(FORWARD, i, (out, yb), loss=len(yb) / len(y), count=len(chunks))
            outs.append(out)
        loss = 0.0
        left = set(range(len(outs)))
        for _ in chunks:
            msg = self._receive(self.down, BACKWARD)
            out = outs[self._gradient_of(msg, left, len(outs))]
            out.backward(msg.tensors[0].to(out.device))
            loss += msg.loss
        return loss, len(y)

    def _gradient_of(self, msg: Message, left: set[int], count: int) -> int:
        """The micro-batch a BACKWARD message from downstream is for, taken off ``left`` (this
        step's ``count`` micro-batches still without their gradient): a repeated or unknown index
        fails the step (it would apply one backward twice, or index nothing)."""
        if msg.microbatch not in left:
            what = "a second time" if msg.microbatch < count else f"in a step of {count} micro-batches"
            raise StageError(f"replica {self.index} stage {self.position}: the gradient of micro-batch "
                             f"{msg.microbatch} came back {what} from stage {self.position + 1}")
        left.remove(msg.microbatch)
        return msg.microbatch

    def _later(self, first: Message) -> tuple[float, int]:
        if first.count < 1:
            raise StageError(f"replica {self.index} stage {self.position}: a step of {first.count} micro-batches")
        up = self.up
        assert up is not None  # a later stage has the stage before it
        kept = []
        n = 0
        for i in range(first.count):  # each micro-batch as soon as it arrives (overlaps the stage before)
            msg = first if i == 0 else self._receive(up, FORWARD)
            if msg.microbatch != i:
                raise StageError(f"replica {self.index} stage {self.position}: micro-batch {msg.microbatch} "
                                 f"arrived as the step's {i}-th")
            act, y = msg.tensors
            inp = act.to(self.parts[0][0]).requires_grad_(act.is_floating_point())
            out = self.forward(inp)
            n += len(y)
            if self.down is None:  # the last stage: the loss, and the input's gradient back at once
                loss = self.loss_fn(out, y.to(out.device)) * msg.loss
                loss.backward()
                up.send(BACKWARD, msg.microbatch, (_grad_of(inp),), loss=float(loss.detach()))
            else:
                self.down.send(FORWARD, msg.microbatch, (out, y), loss=msg.loss, count=first.count)
                kept.append((inp, out))
        left = set(range(len(kept)))
        for _ in kept:
            assert self.down is not None  # (kept only with a downstream neighbour)
            msg = self._receive(self.down, BACKWARD)
            inp, out = kept[self._gradient_of(msg, left, len(kept))]
            out.backward(msg.tensors[0].to(out.device))
            up.send(BACKWARD, msg.microbatch, (_grad_of(inp),), loss=msg.loss)
        return 0.0, n

    def load(self, buffers: list[torch.Tensor]) -> None:
        for s, buf in enumerate(buffers):
            if self.zero_copy:
                self.bound.params_as_views(s, buf)
            else:
                self.bound.load_params(s, buf)


def _grad_of(inp: torch.Tensor) -> torch.Tensor:
    return inp.grad if inp.grad is not None else torch.zeros_like(inp)


def run_stage(job: ReplicaJob, shards: list[ShardHandle] | Callable[[], list[ShardHandle]], up: StageLink | None,
              down: StageLink | None, start_local_step: int = 0, read: Reader | None = None,
              owns_replies: bool = False, abandoned: Callable[[], bool] | None = None) -> ReplicaStats:
    """Run the job's stage (``job.stage.position`` of replica ``job.index``) until the pipeline
    stops (the first stage: the ps says stop or its data ends; the others: the first stage's
    STOP). ``shards``: this stage's shard handles, one per ``job.shards`` (or a function opening
    them). Links are closed at the end; a stage with a downstream neighbour tells it to stop
    first, whatever ended this one. ``abandoned``: asked before every step and every second of a
    wait for the ps, as a replica does (``dtrain.worker.replica.run_replica``): once its chief is
    gone the stage stops (Abandoned), and its STOP ends the stages after it."""
    rep = None
    try:
        rep = StageModel(job, up, down, start_local_step, read, owns_replies)
        stats = _train(rep, job, shards, start_local_step, abandoned=abandoned)
        stats.extra["stage"] = {"position": rep.position, "exchange_s": rep.exchange_s, "exchanges": rep.exchanges,
                                "devices": [str(dev) for dev, _ in rep.parts],
                                "send_s": sum(lk.send_s for lk in (up, down) if lk is not None),
                                "bytes_sent": sum(lk.bytes_sent for lk in (up, down) if lk is not None),
                                "bytes_received": sum(lk.bytes_received for lk in (up, down) if lk is not None),
                                "bytes_shared": sum(lk.bytes_shared for lk in (up, down) if lk is not None),
                                "shared_memory": any(lk.slots is not None for lk in (up, down) if lk is not None)}
        return stats
    finally:
        if down is not None:
            down.send(STOP)
        for link in (down, up):
            if link is not None:
                link.close()
        if rep is not None:
            rep.batches.close()
