"""Sharded sources: discovery, headers, the columns check, the evaluation split, reading a shard."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtrain.data.shards import (
    BadShardError,
    ShardError,
    discover,
    is_sharded,
    read_manifest,
    read_shard,
    split_eval,
)
from tests.helpers import shards


def test_is_sharded_for_globs_directories_and_urls(tmp_path):
    (tmp_path / "d").mkdir()
    assert is_sharded("x/*.parquet") and is_sharded("s3://bucket/data/") and is_sharded("d", tmp_path)
    assert not is_sharded("one.parquet", tmp_path) and not is_sharded("synthetic") and not is_sharded("sklearn:iris")


@pytest.mark.parametrize("fmt", ["parquet", "csv", "npz"])
def test_manifest_from_headers(tmp_path, fmt):
    shards.write(tmp_path / "d", [30, 50, 20], fmt=fmt, row_group=25 if fmt == "parquet" else None)
    m = read_manifest("d/*." + fmt, tmp_path)
    assert m.fmt == fmt and m.rows == 100
    if fmt == "parquet":  # one shard per row group
        assert [(s.name, s.rows) for s in m.shards] == [
            ("part-000.parquet#rg0", 25), ("part-000.parquet#rg1", 5), ("part-001.parquet#rg0", 25),
            ("part-001.parquet#rg1", 25), ("part-002.parquet#rg0", 20)]
    else:
        assert [s.rows for s in m.shards] == [30, 50, 20]
    assert m.feature_shape == (4,) and not m.ids
    # Reading a shard gives its rows, ids in order (the first feature).
    x, y = read_shard(m, m.shards[1])
    assert x.shape == (m.shards[1].rows, 4) and len(y) == len(x)
    assert np.array_equal(x[:, 0], np.arange(len(x)) + (25 if fmt == "parquet" else 30))


def test_a_directory_is_searched_and_a_url_works(tmp_path):
    shards.write(tmp_path / "d" / "sub", [10, 10])
    assert len(discover(str(tmp_path / "d"))) == 2
    assert read_manifest(f"file://{tmp_path}/d/sub/*.parquet").rows == 20


def test_a_glob_matching_nothing_names_the_pattern(tmp_path):
    with pytest.raises(ShardError, match=r"no .* file matches 'missing/\*\.parquet'"):
        discover("missing/*.parquet", tmp_path)


def test_mixed_formats_are_refused(tmp_path):
    shards.write(tmp_path / "d", [10], fmt="csv")
    shards.write(tmp_path / "d", [10, 10], fmt="parquet")
    with pytest.raises(ShardError, match="several formats"):
        discover("d", tmp_path)


def test_a_shard_with_other_columns_is_named_with_the_columns(tmp_path):
    shards.write(tmp_path / "d", [10, 10])
    bad = tmp_path / "d" / "part-009.parquet"
    pq.write_table(pa.table({"sample_id": [1.0], "f0": [1.0], "f1": ["a"], "label": [0]}), bad)
    with pytest.raises(ShardError) as err:
        read_manifest("d/*.parquet", tmp_path)
    msg = str(err.value)
    assert "part-009.parquet" in msg and "f1 (double in part-000.parquet, string here)" in msg and "f2" in msg


def test_a_missing_target_is_named(tmp_path):
    shards.write(tmp_path / "d", [10])
    with pytest.raises(ShardError, match="target column 'y' not found"):
        read_manifest("d/*.parquet", tmp_path, target="y")


def test_split_eval_is_seeded_and_leaves_a_shard_per_replica(tmp_path):
    shards.write(tmp_path / "d", [10] * 10)
    m = read_manifest("d/*.parquet", tmp_path)
    train, test = split_eval(m, 0.2, seed=3, min_train=2)
    assert len(test.shards) == 2 and len(train.shards) == 8
    assert not {s.path for s in train.shards} & {s.path for s in test.shards}
    assert split_eval(m, 0.2, seed=3, min_train=2)[1].shards == test.shards
    with pytest.raises(ShardError, match="fewer than the 10 replicas"):
        split_eval(m, 0.2, seed=3, min_train=10)


def test_a_corrupt_shard_is_a_bad_shard_naming_the_file(tmp_path):
    shards.write(tmp_path / "d", [10, 10])
    m = read_manifest("d/*.parquet", tmp_path)
    (tmp_path / "d" / "part-001.parquet").write_bytes(b"PAR1 not parquet at all PAR1")
    with pytest.raises(BadShardError, match="part-001.parquet"):
        read_shard(m, m.shards[1])


def test_csv_rows_are_counted_as_the_reader_parses_them(tmp_path):
    """Rows used to be counted by newline bytes: a CSV with carriage-return line ends counted 0 rows
    and was dropped from the manifest without a word, and a blank line made the header's count
    disagree with the rows read (the shard then failed when read, mid-run for held-out shards)."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.csv").write_bytes(b"f0,f1,label\r1,2,0\r3,4,1\r5,6,0\r")
    (d / "b.csv").write_bytes(b"f0,f1,label\n1,2,0\n\n3,4,1\n")
    m = read_manifest("d/*.csv", tmp_path)
    assert [(s.name, s.rows) for s in m.shards] == [("a.csv", 3), ("b.csv", 2)]
    for s in m.shards:
        x, y = read_shard(m, s)
        assert len(x) == len(y) == s.rows


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_targets_in_a_shard_are_refused_naming_the_file(tmp_path, bad):
    """Only the features were checked: a NaN or inf regression target passed the reader and the
    statistics pass, and training ran on NaN until the parameter checks stopped it."""
    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"f0": [1.0, 2.0, 3.0], "target": [0.5, bad, 1.5]}), d / "part-000.parquet")
    m = read_manifest("d/*.parquet", tmp_path, target="target")
    with pytest.raises(BadShardError, match=r"part-000\.parquet.*NaN or infinite targets"):
        read_shard(m, m.shards[0])


def test_a_listing_too_large_to_check_is_left_to_the_run(tmp_path, monkeypatch):
    """`dtrain validate` listed a directory source whole (``data.source: /`` walked the file
    system): it now looks at ``LISTING_LIMIT`` entries at most, and says nothing past them (the
    run lists the source). Below the limit, the full check runs."""
    from dtrain.data import shards as module

    d = tmp_path / "d"
    for i in range(6):
        (d / f"sub{i}").mkdir(parents=True)
        (d / f"sub{i}" / "notes.txt").write_text("x")
    monkeypatch.setattr(module, "LISTING_LIMIT", 5)
    assert module.check_source("d", tmp_path) is False  # not looked at whole
    monkeypatch.setattr(module, "LISTING_LIMIT", 100)
    with pytest.raises(ShardError, match="file matches .d."):
        module.check_source("d", tmp_path)
    shards.write(d, [3])
    assert module.check_source("d", tmp_path) is True
    assert module.check_source("d/**/*.parquet", tmp_path) is True
