"""Replication rules as pure state machines: events in, decisions out. No torch, no Dask, no I/O.

The ps actor feeds these with every push and carries out what they decide; they are tested in
microseconds without a cluster (tests/test_replication.py).

- :class:`SyncAggregator` — SyncReplicasOptimizer on one shard: gradients for the shard's current
  step are accumulated; a gradient for an older step is stale and dropped; a second gradient from
  the same replica for the same step is dropped; when ``replicas_to_aggregate`` distinct replicas
  have pushed, the mean is applied and the step advances. With ``total_num_replicas`` larger than
  ``replicas_to_aggregate`` the extra replicas are backups: whatever arrives after the quorum is
  stale and dropped, so stragglers no longer set the pace. In-graph replication reduces a step's
  gradients in its Dask graph and hands the shard one aggregated update (``push_aggregated``).
- :class:`AsyncPolicy` — plain async (apply every push at once) or a staleness bound: a push
  computed on parameters more than ``max_staleness`` updates old is dropped.
- :class:`StalenessGate` — stale synchronous parallel on local steps: a replica more than
  ``max_staleness`` local steps ahead of the slowest live replica waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Accumulate:
    """Keep the gradient; the step is not complete yet (``count`` gradients so far)."""

    step: int
    count: int


@dataclass(frozen=True)
class Apply:
    """Apply the mean of ``count`` accumulated gradients (sync) or this gradient (async); the
    shard's step becomes ``new_step``."""

    new_step: int
    count: int = 1


@dataclass(frozen=True)
class Drop:
    """Throw the gradient away: ``reason`` is ``stale``, ``duplicate`` or ``ahead``."""

    reason: str
    step: int


Decision = Accumulate | Apply | Drop


@dataclass
class SyncAggregator:
    """SyncReplicasOptimizer's per-shard accumulator (see the module docstring)."""

    replicas_to_aggregate: int
    total_num_replicas: int
    step: int = 0
    contributors: set[int] = field(default_factory=set)
    dropped_stale: int = 0
    # Lost replicas excused from the current step's quorum (see excuse()).
    excused: set[int] = field(default_factory=set)
    # Replicas at the end of their data (data.epochs): no step waits for them again (see retire()).
    retired: set[int] = field(default_factory=set)
    # Elastic replicas: the quorum is this share of the live replicas (rounded up), not a count.
    fraction: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.replicas_to_aggregate <= self.total_num_replicas:
            raise ValueError("need 1 <= replicas_to_aggregate <= total_num_replicas")

    def push(self, replica: int, step: int) -> Decision:
        """A gradient from ``replica`` computed on the parameters of ``step``."""
        if not 0 <= replica < self.total_num_replicas:
            raise ValueError(f"replica {replica} is not one of the {self.total_num_replicas} replicas "
                             f"(0..{self.total_num_replicas - 1})")
        if step < self.step:
            self.dropped_stale += 1
            return Drop("stale", self.step)
        if step > self.step:
            # Only possible after a restore moved the shard back; the replica re-pulls.
            self.dropped_stale += 1
            return Drop("ahead", self.step)
        if replica in self.contributors:
            self.dropped_stale += 1
            return Drop("duplicate", self.step)
        self.contributors.add(replica)
        if len(self.contributors) >= self._quorum():
            return self._advance(len(self.contributors))
        return Accumulate(self.step, len(self.contributors))

    def _quorum(self) -> int:
        absent = (self.excused | self.retired) - self.contributors
        live = self.total_num_replicas - len(absent)
        if self.fraction is not None:  # rounded up (the float's error aside)
            share = self.fraction * live - 1e-9
            return max(1, int(share) + (share > int(share)))
        return max(1, min(self.replicas_to_aggregate, live))

    def _advance(self, count: int) -> Apply:
        """The current step is complete (``count`` gradients): start the next one."""
        self.contributors.clear()
        self.excused.clear()
        self.step += 1
        return Apply(self.step, count)

    def excuse(self, replica: int) -> Decision | None:
        """``replica`` was lost and will never push for the current step (its replacement starts
        from a fresh pull): leave it out of this step's quorum. Needed where a replica died between
        its pushes to two shards: the shard it reached moved on, this one would wait for it forever.
        Returns ``Apply`` when the gradients already in now make the quorum (else None); the next
        step needs the full quorum again."""
        if replica in self.contributors:
            return None
        self.excused.add(replica)
        if self.contributors and len(self.contributors) >= self._quorum():
            return self._advance(len(self.contributors))
        return None

    def retire(self, replica: int) -> Decision | None:
        """``replica`` has read all its data (TensorFlow's OutOfRange) and will never push again: this
        step and every later one need the quorum of the others only (replicas own different amounts
        of data, so they finish at different steps). Returns ``Apply`` when the gradients already in
        now make the quorum (else None)."""
        self.retired.add(replica)
        if self.contributors and replica not in self.contributors and len(self.contributors) >= self._quorum():
            return self._advance(len(self.contributors))
        return None

    def rejoin(self, replica: int) -> None:
        """An elastic job's ``replica`` (retired when its worker left, or never started) has a worker
        again: the quorum counts it from now on, as it pulls and pushes for the current step."""
        self.retired.discard(replica)
        self.excused.discard(replica)

    def push_aggregated(self, step: int, count: int) -> Decision:
        """A mean of ``count`` gradients computed on the parameters of ``step`` and aggregated
        elsewhere (in-graph replication: the step's graph reduced them). It is the whole update of
        ``step``; any partial accumulation is superseded."""
        if count < 1:
            raise ValueError(f"an aggregated update needs count >= 1, got {count}")
        if step != self.step:
            self.dropped_stale += 1
            return Drop("stale" if step < self.step else "ahead", self.step)
        return self._advance(count)

    def reset(self, step: int) -> None:
        """Forget partial accumulation (after a restore or a lost replica's generation change); the
        replicas start again, so none is retired."""
        self.step = step
        self.contributors.clear()
        self.excused.clear()
        self.retired.clear()


@dataclass
class AsyncPolicy:
    """Async updates, optionally bounded: a push on parameters more than ``max_staleness`` updates
    old is dropped (``None``: every push is applied)."""

    max_staleness: int | None = None
    step: int = 0
    dropped_stale: int = 0

    def push(self, version: int) -> Decision:
        """A gradient computed on the parameters this shard had at ``version``."""
        if self.max_staleness is not None and self.step - version > self.max_staleness:
            self.dropped_stale += 1
            return Drop("stale", self.step)
        self.step += 1
        return Apply(self.step)

    def reset(self, step: int) -> None:
        self.step = step


@dataclass
class StalenessGate:
    """Stale synchronous parallel: replica r may start local step s only while
    ``s - min(local step of every other live replica) <= max_staleness``."""

    num_replicas: int
    max_staleness: int
    local: dict[int, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)

    def report(self, replica: int, local_step: int) -> None:
        self.local[replica] = max(local_step, self.local.get(replica, 0))
        self.lost.discard(replica)

    def may_proceed(self, replica: int, local_step: int) -> bool:
        others = [self.local.get(r, 0) for r in range(self.num_replicas) if r != replica and r not in self.lost]
        return not others or local_step - min(others) <= self.max_staleness

    def replica_lost(self, replica: int) -> None:
        """A lost replica no longer holds the others back (until it reports again)."""
        self.lost.add(replica)

    def reset(self) -> None:
        """Forget every local step (after a restore the replicas count from their new start;
        :meth:`report` keeps the maximum, so old counts would otherwise outlive the restore)."""
        self.local.clear()
        self.lost.clear()
