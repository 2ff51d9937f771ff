"""ShardCore on its own (ps/core.py): the step's source, the apply and the step's bookkeeping
(checkpoint_every holds, shard 0's records, the stop at ``steps``), the refusals under nan_guard,
and the replies' snapshots. Real torch, no ParameterShard, no event loop."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.ps.replication import AsyncPolicy, SyncAggregator
from dtrain.ps.tokens import TokenSync
from tests.helpers.ps_parts import Sleeper, advance, core_of


def test_the_step_comes_from_the_modes_state_machine():
    """Fails if ``step`` reads the other mode's machine (a sync shard would never move)."""
    sync, _ = core_of("sync")
    assert isinstance(sync.sync, SyncAggregator)
    assert advance(sync) == 1 and sync.policy.step == 0
    tokens, _ = core_of("sync", sync_tokens=True)
    assert isinstance(tokens.sync, TokenSync)
    asynchronous, _ = core_of("async")
    assert isinstance(asynchronous.policy, AsyncPolicy)
    assert advance(asynchronous) == 1 and asynchronous.sync.step == 0


def test_an_apply_steps_the_optimizer_counts_itself_and_wakes_the_connection_threads():
    """Fails if the apply ignores its scale (the mean of a sync step), skips the meter, or does not
    notify ``tcond`` (a direct sync push waiting for the step would sleep to its timeout)."""
    core, waits = core_of("async")
    sleeper = Sleeper(waits).start_sleeping()
    with waits.lock:
        core.policy.push(0)
        core.apply(torch.ones(4), 0.5)
    sleeper.join(5)
    assert sleeper.notified is True
    assert torch.equal(core.param, torch.full((4,), -0.5))
    assert core.meter is not None and core.meter.applies == 1 and core.last_apply_time > 0


@pytest.mark.parametrize(("mode", "index", "holds"), [("sync", 0, True), ("sync", 1, True), ("async", 0, True),
                                                      ("async", 1, False)])
def test_checkpoint_every_holds_each_multiple_on_the_shards_that_move_together(mode, index, holds):
    """Sync: every shard pauses at each multiple of checkpoint_every; async: only the shard that
    counts the global step (the others' steps differ). Fails if a shard misses its pause (the
    checkpoint lands past its step) or an async shard 1 pauses (nobody would release it in step)."""
    core, _ = core_of(mode, index=index, checkpoint_every=2)
    assert advance(core) == 1 and core.hold_at is None
    assert advance(core) == 2 and core.hold_at == (2 if holds else None)


def test_a_checkpoint_every_hold_keeps_the_chiefs_and_none_at_the_last_step():
    """Fails if a multiple overwrites a hold already placed (the chief's snapshot would be taken
    at another step than it asked for) or holds the last step (the run could not end)."""
    core, _ = core_of("sync", steps=4, checkpoint_every=2)
    core.hold_at = 7
    for _ in range(2):
        advance(core)
    assert core.hold_at == 7
    core.hold_at = None
    for _ in range(2):
        advance(core)
    assert core.step == 4 and core.hold_at is None and core.stop


def test_shard_0_closes_a_record_every_summary_every_steps_and_stops_at_steps():
    """Fails if the last step closes no record, an interval is not restarted after its record (the
    means would mix intervals), drain hands a record out twice, or shard 0 does not stop at steps."""
    core, _ = core_of("async", steps=5, summary_every=2)
    for k in range(5):
        with core.waits.lock:
            core.observe(0, float(k), 8, k + 1)
        advance(core)
    records = core.records.drain()
    assert [r["step"] for r in records] == [2, 4, 5]
    assert [r["loss"] for r in records] == [0.5, 2.5, 4.0]
    assert records[-1]["samples"] == 40 and core.records.local_steps == {0: 5}
    assert core.stop and core.records.drain() == []


def test_other_shards_keep_no_records_and_leave_the_stop_to_shard_0():
    """Fails if a shard that does not count the global step counts reports (samples would be
    counted once per shard) or stops itself at steps (its step is not the global step)."""
    core, _ = core_of("async", index=1, steps=2, summary_every=1)
    for k in range(3):
        core.observe(0, 1.0, 8, k + 1)
        advance(core)
    assert core.records.samples_total == 0 and core.records.drain() == [] and not core.stop


def test_a_non_finite_loss_fails_the_run_under_nan_guard_only():
    """Fails if a NaN loss is not caught under nan_guard, is counted as the replica's progress (its
    local step), or fails a run that did not ask for the guard."""
    core, _ = core_of("async", nan_guard=True)
    core.observe(1, math.nan, 8, 3)
    assert core.error is not None and "replica 1 reported a non-finite loss" in core.error
    assert core.records.local_steps == {} and core.records.samples_total == 8
    unguarded, _ = core_of("async")
    unguarded.observe(1, math.nan, 8, 3)
    assert unguarded.error is None


def test_nan_guard_refuses_a_non_finite_gradient_and_only_that():
    """Fails if a gradient with an inf is applied under nan_guard, if a finite gradient whose sum
    overflows is refused (the cheap sum check alone), if a later error replaces the first one, or
    if the check runs without nan_guard."""
    core, _ = core_of("async", nan_guard=True)
    assert not core.bad_grad(torch.tensor([3e38, 3e38, 0.0, 0.0]), 0) and core.error is None
    assert core.bad_grad(torch.tensor([1.0, math.inf, 0.0, 0.0]), 2)
    first = core.error
    assert first is not None and "replica 2 pushed a non-finite gradient at step 0 of shard 0" in first
    assert core.bad_grad(torch.tensor([math.nan] * 4), 3) and core.error == first
    unguarded, _ = core_of("async")
    assert not unguarded.bad_grad(torch.tensor([math.inf] * 4), 0)


def test_replies_are_snapshots_in_a_lazy_bounded_ring_or_the_callers_buffer():
    """Fails if a reply is the live buffer (it changes while on the wire), if the ring grows past
    2 * replicas + 4 buffers or is allocated before an actor-path reply needs it, if a caller's
    buffer is ignored, if in-place readers get a copy, or if any reply goes unmetered."""
    core, _ = core_of("async", replicas=1)
    assert core.ring == []
    outs = [core.snapshot() for _ in range(7)]
    assert len(core.ring) == 6 and outs[6] is outs[0] and len({id(o) for o in outs[:6]}) == 6
    assert all(o is not core.param for o in outs)
    before = outs[6].clone()
    advance(core)  # (a zero gradient: move the parameters by hand)
    core.param.add_(1.0)
    assert torch.equal(outs[6], before)
    mine = torch.empty(4)
    assert core.snapshot(mine) is mine and torch.equal(mine, torch.ones(4)) and len(core.ring) == 6
    assert core.snapshot(core.param) is core.param
    assert core.meter is not None and core.meter.bytes_out == 9 * 16


def test_a_reply_tells_the_replica_to_stop_on_an_error():
    """Fails if an error is not in the reply's stop flag (replicas would train on a failed run)."""
    core, _ = core_of("async", generation=3)
    _, step, stop, generation = core.reply(torch.empty(4))
    assert (step, stop, generation) == (0, False, 3)
    core.error = "failed"
    assert core.reply(torch.empty(4))[2] is True
