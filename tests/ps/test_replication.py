"""dtrain.replication's pure state machines, without a cluster (events in, decisions out)."""

from __future__ import annotations

import pytest

from dtrain.ps.replication import Accumulate, Apply, AsyncPolicy, Drop, StalenessGate, SyncAggregator

# ------------------------------------------------------------------------------ SyncAggregator


def test_sync_accumulates_until_quorum_then_applies_and_advances():
    agg = SyncAggregator(replicas_to_aggregate=3, total_num_replicas=3)
    assert agg.push(0, 0) == Accumulate(step=0, count=1)
    assert agg.push(2, 0) == Accumulate(step=0, count=2)
    assert agg.push(1, 0) == Apply(new_step=1, count=3)
    assert agg.step == 1
    assert agg.contributors == set()
    assert agg.dropped_stale == 0
    # The next step starts afresh with the same replicas.
    assert agg.push(1, 1) == Accumulate(step=1, count=1)


def test_sync_single_replica_applies_every_push():
    agg = SyncAggregator(1, 1)
    for step in range(5):
        assert agg.push(0, step) == Apply(new_step=step + 1, count=1)
    assert agg.step == 5


def test_sync_quorum_needs_distinct_replicas_and_drops_duplicates():
    agg = SyncAggregator(2, 2)
    assert agg.push(0, 0) == Accumulate(0, 1)
    assert agg.push(0, 0) == Drop("duplicate", 0)
    assert agg.step == 0  # a duplicate never completes the step
    assert agg.dropped_stale == 1
    assert agg.push(1, 0) == Apply(1, 2)


def test_sync_drops_stale_gradients_and_counts_them():
    agg = SyncAggregator(2, 2)
    agg.push(0, 0)
    agg.push(1, 0)
    assert agg.push(0, 0) == Drop("stale", 1)
    assert agg.dropped_stale == 1
    # A stale push does not disturb the current step's accumulation.
    assert agg.push(1, 1) == Accumulate(1, 1)
    assert agg.push(1, 0) == Drop("stale", 1)
    assert agg.dropped_stale == 2
    assert agg.push(0, 1) == Apply(2, 2)


def test_sync_drops_gradients_from_the_future():
    agg = SyncAggregator(2, 2, step=3)
    assert agg.push(0, 4) == Drop("ahead", 3)
    assert agg.dropped_stale == 1
    assert agg.contributors == set()


def test_sync_backup_replicas_late_gradients_are_dropped():
    # SyncReplicasOptimizer(replicas_to_aggregate=2, total_num_replicas=3): the slowest
    # replica's gradient of every step arrives after the quorum and is dropped.
    agg = SyncAggregator(replicas_to_aggregate=2, total_num_replicas=3)
    applied = []
    for step in range(4):
        first, second, straggler = (step % 3, (step + 1) % 3, (step + 2) % 3)
        assert agg.push(first, step) == Accumulate(step, 1)
        decision = agg.push(second, step)
        assert decision == Apply(step + 1, 2)
        applied.append(decision)
        assert agg.push(straggler, step) == Drop("stale", step + 1)
    assert agg.step == 4
    assert agg.dropped_stale == 4
    assert all(d.count == 2 for d in applied)


def test_sync_backup_straggler_may_join_a_later_quorum():
    # A straggler that re-pulled the current parameters is as good as any replica.
    agg = SyncAggregator(2, 3)
    agg.push(0, 0)
    agg.push(1, 0)  # step 0 applied without replica 2
    assert agg.push(2, 0) == Drop("stale", 1)
    assert agg.push(2, 1) == Accumulate(1, 1)
    assert agg.push(0, 1) == Apply(2, 2)


def test_sync_reset_forgets_partial_accumulation():
    agg = SyncAggregator(2, 2)
    agg.push(0, 0)
    agg.reset(7)
    assert agg.step == 7 and agg.contributors == set()
    assert agg.push(0, 7) == Accumulate(7, 1)  # replica 0 is no duplicate after the reset
    assert agg.push(0, 0) == Drop("stale", 7)


def test_sync_push_aggregated_is_one_whole_step():
    agg = SyncAggregator(2, 2)
    assert agg.push_aggregated(0, 2) == Apply(1, 2)
    assert agg.push_aggregated(0, 2) == Drop("stale", 1)  # a retried step is not applied twice
    assert agg.push_aggregated(5, 2) == Drop("ahead", 1)
    assert agg.dropped_stale == 2
    assert agg.step == 1
    with pytest.raises(ValueError, match="count >= 1"):
        agg.push_aggregated(1, 0)


@pytest.mark.parametrize(("aggregate", "total"), [(0, 2), (3, 2), (-1, 1)])
def test_sync_rejects_impossible_quorums(aggregate, total):
    with pytest.raises(ValueError, match="replicas_to_aggregate"):
        SyncAggregator(aggregate, total)


@pytest.mark.parametrize("replica", [-1, 2, 5])
def test_sync_rejects_unknown_replicas(replica):
    agg = SyncAggregator(2, 2)
    with pytest.raises(ValueError, match=f"replica {replica} is not one of the 2 replicas"):
        agg.push(replica, 0)
    assert agg.contributors == set() and agg.dropped_stale == 0


# --------------------------------------------------------------------------------- AsyncPolicy


def test_async_unbounded_applies_everything():
    pol = AsyncPolicy()
    assert pol.push(0) == Apply(1)
    assert pol.push(0) == Apply(2)
    assert pol.push(-100) == Apply(3)  # however old
    assert pol.dropped_stale == 0
    assert pol.step == 3


def test_async_bounded_drops_pushes_older_than_max_staleness():
    pol = AsyncPolicy(max_staleness=2)
    for _ in range(5):
        pol.push(pol.step)
    assert pol.step == 5
    assert pol.push(3) == Apply(6)  # 5 - 3 = 2 <= 2
    assert pol.push(3) == Drop("stale", 6)  # 6 - 3 = 3 > 2
    assert pol.push(4) == Apply(7)  # 6 - 4 = 2
    assert pol.dropped_stale == 1
    assert pol.step == 7


def test_async_zero_staleness_applies_only_fresh_pushes():
    pol = AsyncPolicy(max_staleness=0)
    assert pol.push(0) == Apply(1)
    assert pol.push(0) == Drop("stale", 1)
    assert pol.push(1) == Apply(2)
    assert pol.dropped_stale == 1


def test_async_reset_moves_the_step():
    pol = AsyncPolicy(max_staleness=1)
    pol.reset(10)
    assert pol.push(8) == Drop("stale", 10)
    assert pol.push(9) == Apply(11)


# ------------------------------------------------------------------------------- StalenessGate


def test_gate_bounds_the_lead_over_the_slowest_replica():
    gate = StalenessGate(num_replicas=3, max_staleness=2)
    # Nobody has reported: everyone is at local step 0.
    assert gate.may_proceed(0, 1)
    assert gate.may_proceed(0, 2)
    assert not gate.may_proceed(0, 3)
    gate.report(1, 1)
    assert not gate.may_proceed(0, 3)  # replica 2 is still at 0
    gate.report(2, 1)
    assert gate.may_proceed(0, 3)
    assert not gate.may_proceed(0, 4)


def test_gate_ignores_the_asking_replica_itself():
    gate = StalenessGate(2, 1)
    gate.report(0, 10)
    gate.report(1, 5)
    assert gate.may_proceed(1, 6)  # the slow replica may always catch up
    assert not gate.may_proceed(0, 7)
    assert gate.may_proceed(0, 6)


def test_gate_report_keeps_the_highest_local_step():
    gate = StalenessGate(2, 0)
    gate.report(1, 4)
    gate.report(1, 3)  # reordered report
    assert gate.local[1] == 4
    assert gate.may_proceed(0, 4)


def test_gate_lost_replicas_no_longer_hold_others_back():
    gate = StalenessGate(3, 1)
    gate.report(0, 5)
    gate.report(1, 5)
    gate.report(2, 1)
    assert not gate.may_proceed(0, 6)
    gate.replica_lost(2)
    assert gate.may_proceed(0, 6)
    assert not gate.may_proceed(0, 7)  # replica 1 still bounds it
    gate.replica_lost(1)
    assert gate.may_proceed(0, 100)  # nobody else alive
    # A replica that reports again counts again.
    gate.report(2, 2)
    assert not gate.may_proceed(0, 6)
    assert gate.may_proceed(0, 3)


def test_gate_reset_forgets_local_steps():
    gate = StalenessGate(2, 1)
    gate.report(0, 50)
    gate.report(1, 50)
    gate.replica_lost(1)
    gate.reset()
    assert gate.local == {} and gate.lost == set()
    # After a restore both restart from 0: the old counts must not let replica 0 run ahead.
    gate.report(0, 1)
    assert not gate.may_proceed(0, 3)
    assert gate.may_proceed(0, 1)


def test_gate_with_one_replica_never_waits():
    gate = StalenessGate(1, 0)
    assert gate.may_proceed(0, 1000)


def test_sync_excuse_completes_a_step_a_lost_replica_will_never_push():
    """Replica 1 died after pushing step 0 to another shard but not to this one: excusing it lets
    the gradient already here make the quorum; the next step needs every replica again."""
    agg = SyncAggregator(replicas_to_aggregate=2, total_num_replicas=2)
    assert agg.push(0, 0) == Accumulate(0, 1)
    assert agg.excuse(1) == Apply(1, 1)
    assert agg.push(0, 1) == Accumulate(1, 1)  # full quorum again
    assert agg.push(1, 1) == Apply(2, 2)


def test_sync_excuse_before_the_survivors_push_lowers_the_quorum_of_that_step_only():
    agg = SyncAggregator(replicas_to_aggregate=3, total_num_replicas=3)
    assert agg.excuse(2) is None  # nothing accumulated yet: nothing to apply
    assert agg.push(0, 0) == Accumulate(0, 1)
    assert agg.push(1, 0) == Apply(1, 2)
    assert agg.push(0, 1) == Accumulate(1, 1) and agg.push(1, 1) == Accumulate(1, 2)


def test_sync_excuse_of_a_contributor_or_with_backups_to_spare_changes_nothing():
    agg = SyncAggregator(replicas_to_aggregate=2, total_num_replicas=2)
    agg.push(1, 0)
    assert agg.excuse(1) is None  # its gradient for this step is already in
    assert agg.push(0, 0) == Apply(1, 2)
    backups = SyncAggregator(replicas_to_aggregate=2, total_num_replicas=3)
    backups.push(0, 0)
    assert backups.excuse(2) is None  # two replicas are still alive for a quorum of two
    assert backups.push(1, 0) == Apply(1, 2)


def test_a_retired_replica_leaves_every_later_quorum():
    """data.epochs: a replica at the end of its data never pushes again; the others' steps go on."""
    agg = SyncAggregator(3, 3)
    assert isinstance(agg.push(0, 0), Accumulate) and isinstance(agg.push(1, 0), Accumulate)
    done = agg.retire(2)  # the two gradients already in make the quorum now
    assert isinstance(done, Apply) and done.count == 2 and agg.step == 1
    assert isinstance(agg.push(0, 1), Accumulate)
    assert isinstance(agg.push(1, 1), Apply)  # still two: the retirement outlives the step
    assert agg.retire(1) is None  # nothing in yet
    assert isinstance(agg.push(0, 2), Apply)  # the last replica alone
    agg.reset(2)  # a restore: the replicas start again, none retired
    assert isinstance(agg.push(0, 2), Accumulate)


def test_retiring_a_replica_that_already_pushed_waits_for_the_others():
    agg = SyncAggregator(2, 2)
    agg.push(0, 0)
    assert agg.retire(0) is None and agg.step == 0  # its gradient stays; replica 1's completes the step
    assert isinstance(agg.push(1, 0), Apply) and agg.step == 1
    assert isinstance(agg.push(1, 1), Apply)  # and from then on replica 1 alone


def test_elastic_quorum_follows_the_live_replicas():
    # Four slots, two free from the start: a step aggregates the two live replicas.
    agg = SyncAggregator(replicas_to_aggregate=4, total_num_replicas=4)
    assert agg.retire(2) is None and agg.retire(3) is None
    assert isinstance(agg.push(0, 0), Accumulate)
    assert agg.push(1, 0) == Apply(1, 2)
    # Slot 2 gets a worker: from now on a step needs three.
    agg.rejoin(2)
    assert isinstance(agg.push(0, 1), Accumulate) and isinstance(agg.push(1, 1), Accumulate)
    assert agg.push(2, 1) == Apply(2, 3)
    # Replica 0 leaves in the middle of a step whose other gradients are in: retiring it completes the step.
    agg.push(1, 2)
    agg.push(2, 2)
    assert agg.retire(0) == Apply(3, 2)
    # A gradient of the step before a change is stale, as ever.
    assert agg.push(1, 2) == Drop("stale", 3)
    # Rejoining an excused replica counts it again too.
    agg.excuse(3)
    agg.rejoin(3)
    assert 3 not in agg.retired and 3 not in agg.excused


def test_a_fractional_quorum_is_that_share_of_the_live_replicas_rounded_up():
    agg = SyncAggregator(replicas_to_aggregate=4, total_num_replicas=4, fraction=0.75)
    # 4 live: 3 make a step, the fourth is a backup whose late gradient is stale.
    agg.push(0, 0)
    agg.push(1, 0)
    assert agg.push(2, 0) == Apply(1, 3)
    assert agg.push(3, 0) == Drop("stale", 1)
    # 2 live after two leave: ceil(0.75 * 2) = 2.
    agg.retire(2)
    agg.retire(3)
    agg.push(0, 1)
    assert agg.push(1, 1) == Apply(2, 2)
    # 1 live: it alone makes a step; with 3 live again, 3 (ceil 2.25).
    agg.retire(1)
    assert agg.push(0, 2) == Apply(3, 1)
    agg.rejoin(1)
    agg.rejoin(2)
    agg.push(0, 3)
    assert isinstance(agg.push(1, 3), Accumulate)
    assert agg.push(2, 3) == Apply(4, 3)
