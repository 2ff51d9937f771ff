"""TensorFlow's SyncReplicasOptimizer token queue as a pure state machine (``training.sync_tokens``).

No torch, no Dask, no I/O: the ps shard feeds it (:class:`dtrain.ps.token_push.TokenPush`) and it
is tested without a cluster (tests/ps/test_tokens.py), like :mod:`dtrain.ps.replication`.

The default sync mode (:class:`~dtrain.ps.replication.SyncAggregator`) is a barrier: a replica's
push returns once the step it belongs to is applied, every replica then computes on the new
parameters, and one replica counts once per step. TensorFlow's SyncReplicasOptimizer is not a
barrier but a *token queue* beside the global step:

- the chief enqueues ``init_tokens`` tokens holding the global step at start (``get_init_tokens_op``,
  default ``replicas_to_aggregate``), and again after a restore;
- a replica pushes its gradient tagged with its ``local_step``; the accumulator keeps it unless
  ``local_step < global_step`` (stale: silently dropped);
- after pushing, the replica dequeues one token (waiting while the queue is empty) and sets its
  ``local_step`` to the token's value: this is its only wait;
- once ``replicas_to_aggregate`` fresh gradients are in (from any replicas: a fast replica may
  count twice, tokens are not bound to replicas), their mean is applied, the global step advances
  and ``max(total_num_replicas, replicas_to_aggregate)`` tokens of the new step are enqueued.

Hence a lone replica finishes its first step (an init token), gradients computed on tokens of an
old step are dropped (rows S2, S3, S7 of the TF checklist), and ``total_num_replicas <
replicas_to_aggregate`` is valid: each replica contributes several batches to one update (X1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .replication import Accumulate, Apply, Decision, Drop


@dataclass
class TokenSync:
    """SyncReplicasOptimizer with its token queue, for one set of accumulators (module docstring)."""

    replicas_to_aggregate: int
    total_num_replicas: int
    # Tokens the chief enqueues at start and after a restore; None: replicas_to_aggregate (TF's -1).
    init_tokens: int | None = None
    step: int = 0
    dropped_stale: int = 0
    tokens: deque[int] = field(default_factory=deque)
    # Which replicas' gradients are in the current step's mean (a replica may appear twice: X2).
    pushes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.replicas_to_aggregate < 1 or self.total_num_replicas < 1:
            raise ValueError("need replicas_to_aggregate >= 1 and total_num_replicas >= 1")
        if self.init_tokens is None:
            self.init_tokens = self.replicas_to_aggregate
        if self.init_tokens < max(0, self.replicas_to_aggregate - self.total_num_replicas):
            raise ValueError(f"init_tokens {self.init_tokens} < replicas_to_aggregate - total_num_replicas "
                             f"({self.replicas_to_aggregate} - {self.total_num_replicas}): no step could complete")
        self.reset(self.step)

    @property
    def count(self) -> int:
        """Fresh gradients accumulated for the current step."""
        return len(self.pushes)

    @property
    def tokens_per_step(self) -> int:
        """Tokens enqueued after every update: ``max(total_num_replicas, replicas_to_aggregate)``."""
        return max(self.total_num_replicas, self.replicas_to_aggregate)

    def push(self, replica: int, local_step: int) -> Decision:
        """A gradient from ``replica`` tagged with its ``local_step`` (the token it last took)."""
        if not 0 <= replica < self.total_num_replicas:
            raise ValueError(f"replica {replica} is not one of the {self.total_num_replicas} replicas "
                             f"(0..{self.total_num_replicas - 1})")
        if local_step < self.step:
            self.dropped_stale += 1
            return Drop("stale", self.step)
        self.pushes.append(replica)
        if self.count >= self.replicas_to_aggregate:
            return self._advance()
        return Accumulate(self.step, self.count)

    def take(self, replica: int) -> int | None:
        """``replica`` dequeues a token: its new local step, or None while the queue is empty (it
        waits). Any replica may take any token."""
        return self.tokens.popleft() if self.tokens else None

    def _advance(self) -> Apply:
        count = self.count
        self.pushes = []
        self.step += 1
        self.tokens.extend([self.step] * self.tokens_per_step)
        return Apply(self.step, count)

    def reset(self, step: int) -> None:
        """Start (again) at ``step``: forget partial accumulation and the queue, then enqueue the
        init tokens of ``step`` (TF's chief does so at every session start, restores included)."""
        self.step = step
        self.pushes = []
        self.tokens = deque([step] * (self.init_tokens or 0))

    # The default sync mode's replica bookkeeping has no counterpart here: tokens are not bound to
    # replicas, so a lost or retired replica leaves its share to the others (TensorFlow hangs only
    # when no replica is left to push, tensorflow#5022; dtrain's barrier timeout then fires).
    def excuse(self, replica: int) -> Decision | None:
        return None

    def retire(self, replica: int) -> Decision | None:
        return None

    def rejoin(self, replica: int) -> None:
        return None

    def push_aggregated(self, step: int, count: int) -> Decision:
        raise ValueError("sync_tokens applies to between_graph replication only (in_graph aggregates in its graph)")
