"""Shard layouts: parameters <-> flat shard buffers and their buckets, on real models."""

from __future__ import annotations

import pytest

from tests.helpers.layouts import bound


@pytest.mark.parametrize("bucket_numel", [1, 100, 600, 10_000])
def test_buckets_tile_each_shard_from_its_end(bucket_numel):
    _, layout = bound()
    for s, numel in enumerate(layout.shard_numel):
        buckets = layout.buckets(s, bucket_numel)
        assert buckets[0][1] == numel and buckets[-1][0] == 0  # from the end down to the start
        for (lo, hi, names), nxt in zip(buckets, [*buckets[1:], None], strict=True):
            assert lo < hi and (nxt is None or nxt[1] == lo)  # contiguous, no gap, no overlap
            assert hi - lo >= bucket_numel or nxt is None  # only the last may be small
            starts = {p.offset for p in layout.parts if p.shard == s and p.param in names}
            assert min(starts) == lo  # whole parts only
        assert sorted(n for _, _, names in buckets for n in names) == sorted(
            p.param for p in layout.parts if p.shard == s)
