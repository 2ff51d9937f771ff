"""dtrain.ps.tokens (TensorFlow's token queue) without a cluster: the checklist's rows S1-S9 with
TensorFlow's values (TensorFlow's sync_replicas_optimizer_test), X1, X2."""

from __future__ import annotations

import pytest

from dtrain.ps.replication import Accumulate, Apply, Drop
from dtrain.ps.tokens import TokenSync

LR = 2.0


class Toy:
    """sync_replicas_optimizer_test's problem: ps0 holds v0 = 0.0, ps1 v1 = 1.0 and v_sparse =
    [[3.0], [4.0]]; worker i's gradients are g0 = 0.1 + 0.2i, g1 = 0.9 + 0.2i and 0.1 + 0.2i on
    v_sparse's row 1; SGD with lr 2.0; the chief's update applies the mean of the fresh gradients.
    A worker's run is TF's train_op: push its gradients tagged with its local step, then dequeue a
    token (and wait while none is there)."""

    def __init__(self, workers: int, to_aggregate: int, num_tokens: int):
        self.tokens = TokenSync(to_aggregate, workers, init_tokens=num_tokens)
        self.v0, self.v1, self.v_sparse = 0.0, 1.0, [3.0, 4.0]
        self.sums = [0.0, 0.0, 0.0]
        self.local_step = [self.tokens.step] * workers  # local init: local_step := global_step
        self.waiting: list[int] = []  # workers blocked on the token dequeue, in order

    def push(self, i: int):
        decision = self.tokens.push(i, self.local_step[i])
        if not isinstance(decision, Drop):
            for k, g in enumerate((0.1 + 0.2 * i, 0.9 + 0.2 * i, 0.1 + 0.2 * i)):
                self.sums[k] += g
        if isinstance(decision, Apply):
            n = decision.count
            self.v0 -= LR * self.sums[0] / n
            self.v1 -= LR * self.sums[1] / n
            self.v_sparse[1] -= LR * self.sums[2] / n
            self.sums = [0.0, 0.0, 0.0]
        return decision

    def take(self, i: int) -> bool:
        """Dequeue a token for worker i: True when it finished its run, False when it waits."""
        token = self.tokens.take(i)
        if token is None:
            self.waiting.append(i)
            return False
        self.local_step[i] = token
        return True

    def run(self, i: int) -> bool:
        """One sequential run of worker i's train_op (False: it blocks on the token queue)."""
        self.push(i)
        return self.take(i)

    def wake(self) -> list[int]:
        """Workers blocked on the queue take the tokens that arrived, first come first served."""
        done = []
        while self.waiting and self.tokens.tokens:
            i = self.waiting.pop(0)
            assert self.take(i)
            done.append(i)
        return done

    @property
    def global_step(self) -> int:
        return self.tokens.step


def test_two_workers_rows_s1_to_s4():
    toy = Toy(workers=2, to_aggregate=2, num_tokens=2)
    # S1: after session creation.
    assert (toy.v0, toy.v1, toy.global_step, toy.local_step) == (0.0, 1.0, 0, [0, 0])
    assert list(toy.tokens.tokens) == [0, 0]
    # S2: w0 runs alone and finishes (an init token), then w1: the mean is applied.
    assert toy.run(0)
    assert toy.global_step == 0 and toy.v0 == 0.0
    assert toy.run(1)
    assert toy.global_step == 1
    assert toy.v0 == pytest.approx(-0.4)
    assert toy.v1 == pytest.approx(-1.0)
    assert toy.v_sparse == pytest.approx([3.0, 3.6])
    assert toy.local_step == [0, 0]  # both took init tokens of step 0
    assert list(toy.tokens.tokens) == [1, 1]  # max(total, to_aggregate) tokens of the new step
    # S3: the next gradients were computed with local step 0: stale, dropped; the tokens bring step 1.
    assert toy.push(0) == Drop("stale", 1) and toy.take(0)
    assert toy.push(1) == Drop("stale", 1) and toy.take(1)
    assert toy.global_step == 1 and toy.local_step == [1, 1]
    assert (toy.v0, toy.v1) == (pytest.approx(-0.4), pytest.approx(-1.0))
    assert toy.tokens.dropped_stale == 2
    # S4: the queue is empty, so a sequential w0 would block; run concurrently both finish.
    assert not toy.run(0) and toy.waiting == [0] and toy.global_step == 1
    assert toy.push(1) == Apply(2, 2)
    assert toy.wake() == [0] and toy.take(1)
    assert toy.global_step == 2
    assert toy.v0 == pytest.approx(-0.8)
    # TF's test asserts 1 - 2 * (0.9 + 1.1) / 2 * 2.0 = -3.0 (the checklist's "-2.0" drops one update).
    assert toy.v1 == pytest.approx(-3.0)
    assert toy.local_step == [2, 2]


def test_three_workers_one_backup_rows_s5_to_s9():
    toy = Toy(workers=3, to_aggregate=2, num_tokens=3)
    # S5: w0 and w2 run: the first two fresh gradients make the update.
    assert toy.run(0) and toy.run(2)
    assert toy.global_step == 1
    assert toy.v0 == pytest.approx(-0.6)
    assert toy.v1 == pytest.approx(-1.2)
    assert list(toy.tokens.tokens) == [0, 1, 1, 1]  # the third init token, then 3 of step 1
    # S6: w1 runs late: its gradient (local step 0) is dropped; it takes the last init token.
    assert toy.push(1) == Drop("stale", 1) and toy.take(1)
    assert toy.local_step == [0, 0, 0]
    # S7: w0, w1, w2 each run once: all stale (local step 0), dropped; they take the tokens of step 1.
    for i in (0, 1, 2):
        assert toy.push(i) == Drop("stale", 1)
        assert toy.take(i)
    assert toy.global_step == 1 and toy.local_step[1] == 1 and toy.local_step == [1, 1, 1]
    assert (toy.v0, toy.v1) == (pytest.approx(-0.6), pytest.approx(-1.2))
    # S8: w0 starts alone: its gradient counts, then it blocks on the empty queue.
    assert isinstance(toy.push(0), Accumulate) and not toy.take(0)
    assert toy.global_step == 1
    # S9: w1 starts: the update is applied and both finish.
    assert toy.push(1) == Apply(2, 2)
    assert toy.wake() == [0] and toy.take(1)
    assert toy.global_step == 2
    assert toy.v0 == pytest.approx(-1.0)
    assert toy.v1 == pytest.approx(-3.2)


def test_fewer_replicas_than_gradients_per_update_x1():
    """X1: total_num_replicas 2 < replicas_to_aggregate 4: each replica computes two batches per
    update. With TF's least init tokens (4 - 2) no gradient is wasted: global step = pushes / 4."""
    sync = TokenSync(replicas_to_aggregate=4, total_num_replicas=2, init_tokens=2)
    assert sync.tokens_per_step == 4
    local = [0, 0]
    applied = []
    for _ in range(5):  # both replicas push, then both take a token (a lone one would wait here)
        for r in (0, 1):
            decision = sync.push(r, local[r])
            assert not isinstance(decision, Drop)
            if isinstance(decision, Apply):
                applied.append(decision)
        for r in (0, 1):
            token = sync.take(r)
            assert token is not None
            local[r] = token
    # 10 pushes: updates at the 4th and 8th, two gradients of each replica in each.
    assert applied == [Apply(1, 4), Apply(2, 4)]
    assert sync.step == 2 and sync.count == 2 and sync.dropped_stale == 0
    assert sync.pushes == [0, 1] and local == [2, 2]
    # Pushing alone: replica 0's third push of the step waits for replica 1's fourth.
    sync = TokenSync(4, 2, init_tokens=2)
    sync.push(0, 0)
    assert sync.take(0) == 0
    sync.push(0, 0)
    assert sync.take(0) == 0
    sync.push(0, 0)
    assert sync.take(0) is None and sync.step == 0


def test_default_init_tokens_waste_the_first_pushes_x1():
    """TF's default num_tokens (replicas_to_aggregate = 4) with 2 replicas: the two extra init
    tokens of step 0 tag two gradients that arrive after step 0 is applied: dropped as stale."""
    sync = TokenSync(replicas_to_aggregate=4, total_num_replicas=2)
    assert list(sync.tokens) == [0, 0, 0, 0]
    local = [0, 0]
    decisions = []
    for _ in range(4):
        for r in (0, 1):
            decisions.append(sync.push(r, local[r]))
            local[r] = sync.take(r)
    assert decisions[3] == Apply(1, 4)
    assert decisions[4:6] == [Drop("stale", 1), Drop("stale", 1)]
    assert decisions[6:] == [Accumulate(1, 1), Accumulate(1, 2)]
    assert sync.dropped_stale == 2


@pytest.mark.parametrize(("aggregate", "total", "init"), [(4, 2, 1), (3, 1, 0)])
def test_too_few_init_tokens_is_rejected_as_in_tf(aggregate, total, init):
    with pytest.raises(ValueError, match="init_tokens .* < replicas_to_aggregate - total_num_replicas"):
        TokenSync(aggregate, total, init_tokens=init)


def test_tokens_are_not_bound_to_replicas_x2():
    """X2: a fast replica contributes twice to one update; the default mode would drop the second
    as a duplicate."""
    sync = TokenSync(replicas_to_aggregate=2, total_num_replicas=2)
    assert sync.push(0, 0) == Accumulate(0, 1)
    assert sync.take(0) == 0  # replica 0 takes one init token, then pushes again at once
    assert sync.pushes == [0]
    assert sync.push(0, 0) == Apply(1, 2)  # replica 0's two gradients make the update
    assert sync.pushes == [] and sync.step == 1
    assert sync.take(0) == 0 and list(sync.tokens) == [1, 1]  # FIFO: the other init token first
    # Replica 1, on parameters of step 0 (its local init), is stale now; it takes a token of step 1.
    assert sync.push(1, 0) == Drop("stale", 1)
    assert sync.take(1) == 1
    assert sync.push(0, 0) == Drop("stale", 1)  # and so is replica 0's third gradient


def test_reset_refills_the_init_tokens_of_the_restored_step():
    sync = TokenSync(2, 2)
    sync.push(0, 0)
    sync.take(0)
    sync.reset(7)
    assert sync.step == 7 and sync.count == 0 and list(sync.tokens) == [7, 7]
    # A gradient tagged before the restore's step is stale (TF: the first step after a chief
    # restart is wasted, "to make the system robust"); one of the restored step counts.
    assert sync.push(0, 3) == Drop("stale", 7)
    assert sync.push(1, 7) == Accumulate(7, 1)


def test_lost_or_retired_replicas_change_nothing_and_rejects_bad_input():
    sync = TokenSync(2, 2, init_tokens=0)
    assert sync.push(0, 0) == Accumulate(0, 1)
    assert sync.take(0) is None  # no init tokens: the first step needs both replicas
    assert sync.excuse(1) is None and sync.retire(1) is None and sync.step == 0
    assert sync.push(1, 0) == Apply(1, 2)
    assert sync.take(0) == 1 and sync.take(1) == 1 and sync.take(0) is None
    with pytest.raises(ValueError, match="replica 2 is not one of the 2 replicas"):
        sync.push(2, 1)
    with pytest.raises(ValueError, match="between_graph"):
        sync.push_aggregated(1, 2)


def test_the_token_queue_is_pure():
    """Like the replication rules: no torch, no Dask, no I/O (STYLE.md item 3)."""
    from tests.helpers.imports import imported, tops
    from tests.helpers.paths import PKG

    names = imported(PKG / "ps" / "tokens.py")
    assert tops(names) - {"dtrain"} <= {"__future__", "collections", "dataclasses"}
    assert {n for n in names if n.startswith("dtrain")} == {"dtrain.ps.replication"}
