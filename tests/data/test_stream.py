"""A replica's stream over real parquet shards: exactly once per epoch, resumable at any batch,
reshuffled per epoch, a bad shard named or skipped, never a hang."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest

from dtrain.data.shards import BadShardError, read_manifest, read_shard
from dtrain.data.stats import finish, moments
from dtrain.data.stream import ShardStream, StreamLayout, shard_order
from dtrain.errors import OutOfRange
from dtrain.plan.inputs import assign_shards
from tests.helpers import shards

ROWS = [130, 70, 95, 40, 110, 55]  # uneven files: the replicas' shares differ


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    shards.write(d / "data", ROWS, row_group=50)
    return read_manifest(str(d / "data" / "*.parquet"))


def raw(x, y):
    return x.astype(np.float32), y


def drain(stream):
    out = []
    try:
        while True:
            out.append(stream.next()[0][:, 0].astype(int).tolist())
    except OutOfRange:
        return out
    finally:
        stream.close()


def streams(manifest, replicas=2, batch=16, window=64, epochs=2, starts=None, **kw):
    groups = assign_shards([s.rows for s in manifest.shards], replicas)
    out = []
    for r, idx in enumerate(groups):
        parts = [manifest.shards[i] for i in idx]
        layout = StreamLayout(tuple(p.rows for p in parts), batch, window, seed=5, replica=r, epochs=epochs)
        out.append(ShardStream(layout, parts, lambda s: read_shard(manifest, s), raw,
                               start=(starts or {}).get(r, 0), **kw))
    return out


@pytest.mark.parametrize("window", [1, 50, 64, 1000])
def test_every_sample_exactly_once_per_epoch_up_to_each_replicas_last_partial_batch(manifest, window):
    batches = [drain(s) for s in streams(manifest, window=window)]
    groups = assign_shards([s.rows for s in manifest.shards], 2)
    counts = collections.Counter(i for rep in batches for b in rep for i in b)
    assert set(counts.values()) <= {1, 2}
    for r, idx in enumerate(groups):
        n = sum(manifest.shards[i].rows for i in idx)
        assert len(batches[r]) == 2 * (n // 16)  # two epochs, the partial tail dropped
        assert all(len(b) == 16 for b in batches[r])
        # each epoch drops fewer than one batch of the replica's samples, and the rest is read once
        for epoch in (0, 1):
            seen = [i for b in batches[r][epoch * (n // 16):(epoch + 1) * (n // 16)] for i in b]
            assert len(set(seen)) == len(seen) == n - n % 16
    assert sum(1 for v in counts.values() if v == 2) >= manifest.rows - 2 * 2 * 15


def test_the_replicas_read_disjoint_samples(manifest):
    a, b = (set(i for batch in rep for i in batch) for rep in (drain(s) for s in streams(manifest, epochs=1)))
    assert a and b and not a & b


def test_a_resumed_stream_continues_exactly_where_the_position_says(manifest):
    full = drain(streams(manifest, replicas=1, window=50)[0])
    for k in (1, 3, 4, 7, 18, 19, len(full) - 1, len(full)):
        rest = drain(streams(manifest, replicas=1, window=50, starts={0: k})[0])
        assert rest == full[k:], k


def test_shard_order_and_windows_reshuffle_every_epoch_from_the_seed(manifest):
    assert not np.array_equal(shard_order(12, 5, 0, 0), shard_order(12, 5, 0, 1))
    assert np.array_equal(shard_order(12, 5, 0, 1), shard_order(12, 5, 0, 1))
    batches = drain(streams(manifest, replicas=1)[0])
    half = len(batches) // 2
    assert batches[:half] != batches[half:]
    assert batches == drain(streams(manifest, replicas=1)[0])  # the same seed: the same batches


def test_locate_names_the_epoch_shard_and_offset(manifest):
    layout = StreamLayout((50, 50, 30), 10, 20, seed=0, replica=0, shuffle=False)
    assert layout.batches_per_epoch == 13
    assert layout.locate(0) == {"epoch": 0, "batch": 0, "shard": 0, "offset": 0}
    assert layout.locate(7) == {"epoch": 0, "batch": 7, "shard": 1, "offset": 10}  # sample 70: window 60
    assert layout.locate(13 + 12) == {"epoch": 1, "batch": 12, "shard": 2, "offset": 20}


def test_a_corrupt_shard_fails_the_stream_naming_it_after_the_good_batches(manifest, tmp_path):
    shards.write(tmp_path / "d", [40, 40, 40])
    m = read_manifest(str(tmp_path / "d" / "*.parquet"))
    (tmp_path / "d" / "part-002.parquet").write_bytes(b"garbage")
    layout = StreamLayout((40, 40, 40), 8, 40, seed=0, replica=0, shuffle=False, epochs=1)
    stream = ShardStream(layout, list(m.shards), lambda s: read_shard(m, s), raw)
    got = []
    t0 = time.monotonic()
    with pytest.raises(BadShardError, match="part-002.parquet") as err:
        while True:
            got.append(stream.next())
    stream.close()
    causes, e = 0, err.value  # a finite chain of causes: Dask walks it to report the replica's failure
    while e.__cause__ is not None and causes < 10:
        e, causes = e.__cause__, causes + 1
    assert causes < 10
    assert len(got) == 10 and time.monotonic() - t0 < 30  # the two good files' batches first; no hang


def test_skip_bad_files_leaves_the_file_out_and_counts_it(tmp_path):
    shards.write(tmp_path / "d", [40, 40, 40])
    m = read_manifest(str(tmp_path / "d" / "*.parquet"))
    (tmp_path / "d" / "part-001.parquet").write_bytes(b"garbage")
    layout = StreamLayout((40, 40, 40), 8, 16, seed=0, replica=0, epochs=2)
    stream = ShardStream(layout, list(m.shards), lambda s: read_shard(m, s), raw, skip_bad=True)
    ids = [i for b in drain(stream) for i in b]
    assert sorted(collections.Counter(ids).items()) == [(i, 2) for i in list(range(40)) + list(range(80, 120))]
    assert stream.counters.bad_files == ["part-001.parquet#rg0"] * 2  # tried, and counted, every epoch
    assert stream.counters.batches == 2 * 15


def test_statistics_add_up_over_shards(manifest):
    parts = [moments(*read_shard(manifest, s)) for s in manifest.shards]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    x = np.concatenate([read_shard(manifest, s)[0] for s in manifest.shards])
    stats = finish(total, feature_shape=(4,), ids=False, standardize=True)
    assert stats.task == "classification" and stats.num_classes == 2 and stats.samples == manifest.rows
    assert np.allclose(stats.mean, x.mean(axis=0), rtol=1e-5) and np.allclose(stats.std, x.std(axis=0), rtol=1e-4)
