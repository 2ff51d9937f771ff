"""dtrain.data.sampling: each replica's batches, deterministic, disjoint, and together the
single-process global batch."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.data.sampling import ShardIterator


def test_shard_iterator_deterministic_and_disjoint() -> None:
    n, b, R = 103, 8, 3
    its = [ShardIterator(n, b, r, R, seed=5) for r in range(R)]
    again = ShardIterator(n, b, 1, R, seed=5)
    assert its[0].steps_per_epoch == 103 // 24 == 4
    for step in range(10):  # crosses two epoch boundaries
        batches = [it.next_indices() for it in its]
        assert all(len(x) == b for x in batches)
        assert np.array_equal(again.next_indices(), batches[1])
        union = np.concatenate(batches)
        assert len(set(union.tolist())) == R * b  # disjoint within a step
        single = ShardIterator.global_batch_indices(step, R * b, n_samples=n, seed=5)
        assert np.array_equal(union, single)  # together: exactly the single-process batch
        solo = ShardIterator(n, R * b, 0, 1, seed=5)
        solo.seek(step)
        assert np.array_equal(solo.next_indices(), single)


def test_shard_iterator_epoch_wrap() -> None:
    n, b = 10, 3
    it = ShardIterator(n, b, 0, 1, seed=1)
    epoch0 = np.concatenate([it.next_indices() for _ in range(3)])  # 3 steps, 1 sample dropped
    assert it.state() == {"epoch": 1, "position": 0}
    assert len(set(epoch0.tolist())) == 9
    assert np.array_equal(epoch0, np.random.default_rng([1, 0]).permutation(n)[:9])
    epoch1 = np.concatenate([it.next_indices() for _ in range(3)])
    assert np.array_equal(epoch1, np.random.default_rng([1, 1]).permutation(n)[:9])
    assert not np.array_equal(epoch0, epoch1)
    plain = ShardIterator(n, b, 1, 2, seed=1, shuffle=False)
    assert [plain.next_indices().tolist() for _ in range(2)] == [[3, 4, 5], [3, 4, 5]]
    with pytest.raises(ValueError, match="cannot fill"):
        ShardIterator(5, 3, 0, 2, seed=0)
    with pytest.raises(ValueError, match="replica_index"):
        ShardIterator(50, 3, 2, 2, seed=0)


def test_shard_iterator_state_resume() -> None:
    it = ShardIterator(50, 4, 1, 2, seed=9)
    for _ in range(13):
        it.next_indices()
    state = it.state()
    assert state == {"epoch": 2, "position": 1} and it.local_step == 13
    assert all(type(v) is int for v in state.values())
    expected = [it.next_indices() for _ in range(10)]
    resumed = ShardIterator(50, 4, 1, 2, seed=9)
    resumed.load_state(state)
    assert all(np.array_equal(a, resumed.next_indices()) for a in expected)
    sought = ShardIterator(50, 4, 1, 2, seed=9)
    sought.seek(13)
    assert sought.state() == state
    with pytest.raises(ValueError, match="invalid iterator state"):
        resumed.load_state({"epoch": 0, "position": 6})
