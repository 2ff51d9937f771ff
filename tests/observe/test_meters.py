"""The shard's meter and the replica's throttled report (no cluster)."""

from __future__ import annotations

import time

from dtrain.observe.meters import STALENESS_LE, Every, ShardMeter, staleness_bucket


def test_staleness_buckets_match_their_upper_bounds():
    assert [staleness_bucket(s) for s in (0, 1, 2, 3, 4, 5, 8, 9, 32, 33, 1000)] == [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 7]
    assert len(STALENESS_LE) == 7


def test_shard_meter_counts_pushes_bytes_staleness_and_loss_per_bucket():
    m = ShardMeter(dense_bytes=400)
    m.push()
    assert "staleness" not in m.snapshot()  # sync pushes carry none
    m = ShardMeter(dense_bytes=400)
    m.push(0, 0, 1.0)
    m.push(0, 0, 3.0)
    m.push(0, 40, 5.0)
    m.push(24, 5, float("nan"))  # a non-finite loss is counted, not averaged; 24 bytes of table rows
    snap = m.snapshot()
    assert snap["pushes"] == 4 and snap["bytes_in"] == 1624
    st = snap["staleness"]
    assert st["counts"] == [2, 0, 0, 0, 1, 0, 0, 1] and st["max"] == 40 and st["mean"] == 45 / 4
    assert st["loss"][0] == 2.0 and st["loss"][7] == 5.0 and st["loss"][4] is None


def test_every_throttles_and_a_failing_publisher_is_dropped():
    got = []
    e = Every(got.append, 0.05)
    now = time.perf_counter()
    e.tick(now, lambda: 1)  # too soon after creation
    e.tick(now + 0.06, lambda: 2)
    e.tick(now + 0.07, lambda: 3)  # too soon after the last
    e.tick(now + 0.2, lambda: 4)
    assert got == [2, 4]

    calls = []

    def boom(value):
        calls.append(value)
        raise RuntimeError("worker closing")

    e = Every(boom, 0.0)
    e.tick(time.perf_counter() + 1, lambda: 1)  # does not raise
    e.tick(time.perf_counter() + 2, lambda: 2)  # dropped: not called again (nor its snapshot taken)
    assert calls == [1]
