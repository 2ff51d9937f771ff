"""Criteo-layout input: reading TSV files into packed records, bad lines named by file, line and
field, Criteo and parquet record sources through the manifest, the shard reader and the stream, and
the generator of Criteo-like data. Real files in tmp_path."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtrain.data import criteo
from dtrain.data.criteo import (
    CRITEO_1TB_CARDINALITIES,
    CRITEO_COLUMNS,
    CriteoError,
    count_lines,
    criteo_layout,
    hex_ids,
    read_criteo,
)
from dtrain.data.features import MISSING_ID, CategoricalColumn, RecordLayout, dense_transform, hash64
from dtrain.data.shards import (
    BadRecordError,
    BadShardError,
    ShardError,
    discover,
    is_sharded,
    manifest_for,
    read_manifest,
    read_shard,
    split_eval,
)
from dtrain.data.stream import ShardStream, StreamLayout
from examples.make_criteo_like import cardinalities, generate

LAYOUT = RecordLayout(("I1", "I2", "I3"), (CategoricalColumn("C1"), CategoricalColumn("C2", 3),
                                           CategoricalColumn("C26", weighted=True)))


def line(label: object = 1, **fields: object) -> str:
    """One Criteo line: the label, then every I and C field (empty unless given)."""
    return "\t".join([str(label), *(str(fields.get(c, "")) for c in CRITEO_COLUMNS[1:])])


HAND = [
    line(1, I1=3, I2=-2, C1="68fd1e64", C2="0a,ff,1B", C26="00000001"),
    line(0, I2=5, I3=0, C26="ABCDEF12"),
    line(1, I1=1000000, I2=-1, I3=7, C1="ffffffff", C2="7"),
]


def write(path: Path, lines: list[str], newline_at_end: bool = True) -> Path:
    text = ("\n".join(lines) + ("\n" if newline_at_end else "")).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return path


# ---------------------------------------------------------------- read_criteo


@pytest.mark.parametrize("name", ["day_0.tsv", "day_0.tsv.gz"])
def test_read_criteo_decodes_negatives_empties_hex_and_multi_hot(tmp_path, name):
    x, y = read_criteo(write(tmp_path / name, HAND), LAYOUT)
    assert x.dtype == np.int64 and x.shape == (3, LAYOUT.width) and y.dtype == np.float32
    assert y.tolist() == [1, 0, 1]
    dense, ids, weights = LAYOUT.unpack_numpy(x)
    # Dense: log(1 + max(x, 0)); a negative and an empty field both read 0.
    assert np.array_equal(dense, dense_transform([[3, -2, np.nan], [np.nan, 5, 0], [1e6, -1, 7]]))
    (c1, n1), (c2, n2), (c26, n26) = ids
    assert c1.tolist() == [0x68FD1E64, MISSING_ID, 0xFFFFFFFF] and n1.tolist() == [1, 1, 1]
    assert c2.tolist() == [0x0A, 0xFF, 0x1B, MISSING_ID, 7] and n2.tolist() == [3, 1, 1]  # either case
    assert c26.tolist() == [1, 0xABCDEF12, MISSING_ID] and weights[2].tolist() == [1.0, 1.0, 1.0]


def test_read_criteo_from_a_line_on_and_a_last_line_without_newline(tmp_path):
    path = write(tmp_path / "d.tsv", HAND, newline_at_end=False)
    assert count_lines(str(path)) == 3
    x, y = read_criteo(path, LAYOUT, first_line=1)
    assert y.tolist() == [0, 1] and np.array_equal(x, read_criteo(path, LAYOUT)[0][1:])


def test_hex_ids_match_python_int_parsing():
    rng = np.random.default_rng(0)
    fields = []
    for _ in range(500):
        k = int(rng.integers(0, 4))
        fields.append(",".join(f"{int(v):x}" if rng.random() < 0.5 else f"{int(v):08X}"
                               for v in rng.integers(0, 2**63 - 1, k, dtype=np.int64) >> rng.integers(0, 60, k)))
    values, lengths = hex_ids(fields)
    want = [[int(t, 16) for t in f.split(",")] if f else [MISSING_ID] for f in fields]
    assert lengths.tolist() == [len(w) for w in want]
    assert values.tolist() == [v for w in want for v in w]
    assert hex_ids(["7fffffffffffffff"])[0].tolist() == [2**63 - 1]



@pytest.mark.parametrize("odd", [None, "123456789,1234567", "1234567,123456789", "12345678,,2345678", "1234567x"])
def test_lists_of_eight_digit_ids_match_python_int_parsing(odd):
    """Criteo's multi-hot case (8-digit ids, commas every 9th byte, empty fields) takes a shortcut;
    fails if it misplaces an empty field's missing id, miscounts a list, or accepts a field that only
    looks like that case (right length, commas elsewhere), which must reach the general parser."""
    rng = np.random.default_rng(1)
    fields = [",".join(f"{int(v):08x}" for v in rng.integers(0, 2**32, int(rng.integers(0, 4)))) for _ in range(300)]
    if odd is not None:
        fields[150] = odd
    want = []
    for f in fields:
        tokens = f.split(",") if f else []
        if any(not t or any(c not in "0123456789abcdefABCDEF" for c in t) for t in tokens):
            with pytest.raises(ValueError, match="row 150"):
                hex_ids(fields)
            return
        want.append([int(t, 16) for t in tokens] or [MISSING_ID])
    values, lengths = hex_ids(fields)
    assert lengths.tolist() == [len(w) for w in want]
    assert values.tolist() == [v for w in want for v in w]



def general_parse(fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The general hex parser on ``fields``, bypassing the shortcuts for 8-digit ids."""
    arr = pa.array(fields, type=pa.string())
    offs = np.frombuffer(arr.buffers()[1], np.int32)[:len(arr) + 1].astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], np.uint8)[:offs[-1]] if offs[-1] else np.empty(0, np.uint8)
    return criteo._hex_lists(data, offs, np.diff(offs), arr)


@pytest.mark.parametrize("empty", [0.0, 0.1, 1.0])
def test_the_eight_digit_shortcuts_are_taken_and_agree_with_the_general_parser(empty):
    """Single ids and lists of 8-digit ids (either case, some fields empty) take the shortcuts and
    read as the general parser reads them; a single-id column reports no lengths (one id each)."""
    rng = np.random.default_rng(int(empty * 10))
    digits = [f"{int(v):08x}" if rng.random() < 0.5 else f"{int(v):08X}" for v in rng.integers(0, 2**32, 3000)]
    single = ["" if rng.random() < empty else d for d in digits[:400]]
    values, lengths = criteo._hex_ids(single)
    want = general_parse(single)
    assert lengths is None and values.tolist() == want[0].tolist() and want[1].tolist() == [1] * 400
    lists = []
    for _ in range(400):
        k = 0 if rng.random() < empty else int(rng.integers(1, 5))
        lists.append(",".join(digits[int(i)] for i in rng.integers(0, len(digits), k)))
    arr = pa.array(lists, type=pa.string())
    offs = np.frombuffer(arr.buffers()[1], np.int32)[:401].astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], np.uint8)[:offs[-1]] if offs[-1] else np.empty(0, np.uint8)
    fast = criteo._eight_digit_lists(data, offs, np.diff(offs))
    assert fast is not None  # (taken: not left to the general parser)
    want = general_parse(lists)
    assert fast[0].tolist() == want[0].tolist() and fast[1].tolist() == want[1].tolist()
    assert [a.tolist() for a in hex_ids(lists)] == [want[0].tolist(), want[1].tolist()]


@pytest.mark.parametrize("odd", [
    ["1234,678,12345678", "123456781234567,1234567812"],  # 9k - 1 bytes each, the commas add up
    ["12345678x12345678"],
    ["12345678,1234567,"],
    [",12345678"],
    ["1234567,,"],
])
def test_fields_shaped_like_eight_digit_lists_but_not_read_as_python_reads_them(odd):
    """Lengths of ``9k - 1`` and, over the column, the right number of commas, but misplaced: the
    shortcut must leave them to the general parser, which reads them or names the bad field."""
    rng = np.random.default_rng(2)
    fields = [",".join(f"{int(v):08x}" for v in rng.integers(0, 2**32, int(rng.integers(0, 4)))) for _ in range(300)]
    fields[150:150 + len(odd)] = odd
    tokens = [f.split(",") if f else [] for f in fields]
    if any(not t or any(c not in "0123456789abcdefABCDEF" for c in t) for f in tokens for t in f):
        with pytest.raises(ValueError, match="^row 150: "):
            hex_ids(fields)
        return
    values, lengths = hex_ids(fields)
    assert lengths.tolist() == [max(len(f), 1) for f in tokens]
    assert values.tolist() == [v for f in tokens for v in ([int(t, 16) for t in f] or [MISSING_ID])]

BAD = [  # (line 3 of 4 replaced by ..., the message after "FILE:")
    (line(1, I4="x1"), r"3: I4: 'x1' is not an integer"),
    (line(1, I4="1.5"), r"3: I4: '1.5' is not an integer"),
    (line(1, C7="zz12"), r"3: C7: 'zz12' is not a hexadecimal id"),
    (line(1, C1="0a,0b,0c"), r"3: C1: 3 ids \('0a,0b,0c'\), more than the column's max_ids 1 \(a single-id column: "
                             r"raise its max_ids"),
    (line(1, C2="0a,0b,0c,0d"), r"3: C2: 4 ids \('0a,0b,0c,0d'\), more than the column's max_ids 3$"),
    (line(1, C2="0a,,0c"), r"3: C2: '0a,,0c' has an empty id"),
    (line(1, C2="0a,"), r"3: C2: '0a,' has an empty id"),
    (line(1, C26="12345678901234567"), r"3: C26: '12345678901234567' has an id of more than 16 hex digits"),
    (line(1, C1="8000000000000000"), r"3: C1: '8000000000000000' holds an id above 7fffffffffffffff"),
    (line(2), r"3: label: 2 is not 0 or 1"),
    (line(""), r"3: label: missing: an empty line, or an empty label field"),
    (line(1)[:-1], r"3: has 39 tab-separated field\(s\); a Criteo line has 40"),
    (line(1) + "\tx", r"3: has 41 tab-separated field\(s\)"),
    ("", r"3: label: missing: an empty line"),  # (pyarrow reads an empty line as a row of empty fields)
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[m.split(":")[1].strip().split(" ")[0] for _, m in BAD])
@pytest.mark.parametrize("name", ["d.tsv", "d.tsv.gz"])
def test_a_bad_line_is_named_by_file_line_and_field(tmp_path, bad, message, name):
    layout = criteo_layout(("I1", "I4"), ("C1", "C2", "C7", "C26"), max_ids={"C2": 3})
    path = write(tmp_path / name, [HAND[0], HAND[1], bad, HAND[2]])
    with pytest.raises(CriteoError, match=f"^{path}:{message}") as e:
        read_criteo(path, layout)
    assert isinstance(e.value, BadShardError) and isinstance(e.value, ValueError)  # skip_bad_files skips it


@pytest.mark.parametrize("use_threads", [False, True])
def test_a_bad_line_deep_in_a_large_file_is_named_by_its_line(tmp_path, use_threads):
    """Past pyarrow's first blocks (read on one thread or several): the line is still the file's."""
    (path,) = generate(tmp_path / "g", 12000, seed=1, gzip=False)
    lines = path.read_text().splitlines()
    layout = criteo_layout()
    for n, bad, message in [(11000, "C7", "'zz12' is not a hexadecimal id"), (9999, "I4", "'x' is not an integer")]:
        fields = lines[n - 1].split("\t")
        fields[CRITEO_COLUMNS.index(bad)] = message.split("'")[1]
        broken = tmp_path / "broken.tsv"
        write(broken, lines[:n - 1] + ["\t".join(fields)] + lines[n:])
        with pytest.raises(CriteoError, match=f"^{broken}:{n}: {bad}: {message}"):
            read_criteo(broken, layout, use_threads=use_threads)
    write(broken, lines[:7776] + ["1\t2"] + lines[7777:])
    with pytest.raises(CriteoError, match=f"^{broken}:7777: has 2 tab-separated"):
        read_criteo(broken, layout, use_threads=use_threads)


def test_a_layout_naming_columns_criteo_lacks_is_refused(tmp_path):
    path = write(tmp_path / "d.tsv", HAND)
    with pytest.raises(ValueError, match="has no I14/C0 column here: its dense features are I1..I13"):
        read_criteo(path, RecordLayout(("I14",), (CategoricalColumn("C0"),)))


def test_a_truncated_gzip_file_is_named(tmp_path):
    path = write(tmp_path / "t.tsv.gz", HAND * 2000)
    path.write_bytes(path.read_bytes()[:-200])
    for read in (lambda: read_criteo(path, LAYOUT), lambda: count_lines(str(path))):
        with pytest.raises(CriteoError, match=f"^{path}: cannot be read: .*runcated"):
            read()


def test_count_lines_streams_and_checks_the_first_line(tmp_path):
    assert count_lines(str(write(tmp_path / "a.tsv.gz", HAND * 1000))) == 3000
    with pytest.raises(CriteoError, match=r"b.tsv:1: has 3 tab-separated field\(s\)"):
        count_lines(str(write(tmp_path / "b.tsv", ["1\t2\t3"])))


# ---------------------------------------------------------------- the sharded source


def test_criteo_files_are_a_sharded_source_with_one_shard_per_file(tmp_path):
    write(tmp_path / "d" / "day_0.tsv.gz", HAND)
    write(tmp_path / "d" / "day_1.tsv", HAND[:2])
    write(tmp_path / "d" / "empty.tsv", [], newline_at_end=False)
    assert is_sharded("d/day_0.tsv.gz", tmp_path) and is_sharded("one.tsv")  # even a single file
    assert len(discover("d", tmp_path)) == 3  # .tsv and .tsv.gz: one format
    m = read_manifest("d", tmp_path, layout=LAYOUT)
    assert (m.fmt, m.target, m.ids, m.feature_shape, m.layout) == ("criteo", "label", True, (LAYOUT.width,), LAYOUT)
    assert m.features == ("I1", "I2", "I3", "C1", "C2", "C26")
    assert [(s.name, s.rows) for s in m.shards] == [("day_0.tsv.gz", 3), ("day_1.tsv", 2)]  # no empty shard
    x, y = read_shard(m, m.shards[0])
    assert np.array_equal(x, read_criteo(tmp_path / "d" / "day_0.tsv.gz", LAYOUT)[0]) and y.tolist() == [1, 0, 1]
    cached = manifest_for("d", str(tmp_path), "label", layout=LAYOUT)
    assert cached == m and manifest_for("d", str(tmp_path), "label", layout=LAYOUT) is cached  # keyed on the layout
    assert m.shards[0].part is None
    assert read_manifest("d/day_1.tsv", tmp_path, layout=LAYOUT).rows == 2
    train, test = split_eval(m, 0.5, 0, 1)
    assert train.layout == LAYOUT and test.layout == LAYOUT and len(train.shards) + len(test.shards) == 2


def test_a_criteo_source_needs_a_layout_and_the_label_target(tmp_path):
    write(tmp_path / "d" / "a.tsv", HAND)
    with pytest.raises(ShardError, match=r"is Criteo-layout data: declare the model's features \(model.features\) "
                                         "so dtrain knows which columns to read"):
        read_manifest("d", tmp_path)
    with pytest.raises(ShardError, match="set data.target: label"):
        read_manifest("d", tmp_path, target="click", layout=LAYOUT)
    with pytest.raises(ShardError, match="a.tsv:1: has 2 tab-separated"):
        write(tmp_path / "d" / "a.tsv", ["1\t2"])
        read_manifest("d", tmp_path, layout=LAYOUT)


def _stream_rows(m, shards, batch, window, epochs=1, skip_bad=False):
    layout = StreamLayout(tuple(s.rows for s in shards), batch, window, seed=3, replica=0, epochs=epochs)
    stream = ShardStream(layout, shards, lambda s: read_shard(m, s), lambda x, y: (x, y), skip_bad=skip_bad)
    out = []
    try:
        while True:
            x, y = stream.next()
            out.append(np.column_stack([x, y.view(np.int32).astype(np.int64)]))
    except Exception as exc:  # OutOfRange ends it
        if type(exc).__name__ != "OutOfRange":
            raise
    finally:
        stream.close()
    return np.concatenate(out), stream.counters


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def test_the_stream_yields_every_packed_row_exactly_once_per_epoch(tmp_path):
    generate(tmp_path / "d", 96, files=3, seed=2, multi_hot=2, max_ids=3)
    layout = criteo_layout(max_ids={"C1": 3, "C2": 3})
    m = read_manifest("d", tmp_path, layout=layout)
    want = np.concatenate([np.column_stack([x, y.view(np.int32).astype(np.int64)])
                           for x, y in (read_criteo(s.path, layout) for s in m.shards)])
    got, _ = _stream_rows(m, list(m.shards), batch=16, window=40, epochs=2)
    assert len(got) == 2 * 96
    assert np.array_equal(_sorted(got[:96]), _sorted(want)) and np.array_equal(_sorted(got[96:]), _sorted(want))
    assert not np.array_equal(got[:96], want)  # shuffled, not in file order


def test_a_corrupt_criteo_file_is_skipped_with_skip_bad_files(tmp_path):
    generate(tmp_path / "d", 64, files=2, seed=2)
    lines = [line(0, C1="00000001")] * 10
    lines[6] = line(0, C1="nothex!!")
    write(tmp_path / "d" / "part-00002.tsv.gz", lines)  # its first line is fine: the manifest takes it
    layout = criteo_layout()
    m = read_manifest("d", tmp_path, layout=layout)
    with pytest.raises(CriteoError, match=r"part-00002.tsv.gz:7: C1: 'nothex!!' is not a hexadecimal id"):
        _stream_rows(m, list(m.shards), batch=8, window=16)
    got, counters = _stream_rows(m, list(m.shards), batch=8, window=16, skip_bad=True)
    assert counters.bad_files == ["part-00002.tsv.gz"]
    good = np.concatenate([np.column_stack([x, y.view(np.int32).astype(np.int64)])
                           for x, y in (read_criteo(s.path, layout) for s in m.shards[:2])])
    assert np.array_equal(_sorted(got), _sorted(good))  # every good row once, nothing from the bad file


# ---------------------------------------------------------------- parquet records

PARQUET_LAYOUT = RecordLayout(("d1",), (CategoricalColumn("C1"), CategoricalColumn("C2", 2, weighted=True),
                                        CategoricalColumn("C3"), CategoricalColumn("C4", 2)))


def parquet_table(**change: list) -> pa.Table:
    columns = {
        "label": pa.array([0, 1, 1, 0]),
        "d1": pa.array([0.5, 1.0, 2.0, -3.0], pa.float32()),
        "C1": pa.array([5, None, 7, 2**40], pa.int64()),
        "C2": pa.array([[1, 2], [], None, [3]], pa.list_(pa.int64())),
        "C2_weights": pa.array([[0.5, 2.0], [], None, [1.5]], pa.list_(pa.float32())),
        "C3": pa.array(["a", None, "café", "a"]),
        "C4": pa.array([["x", "y"], ["x"], [], None], pa.list_(pa.string())),
    }
    for k, v in change.items():
        columns[k] = pa.array(v, columns[k].type)
    return pa.table(columns)


def write_parquet(tmp_path: Path, table: pa.Table) -> Path:
    path = tmp_path / "p" / "part-0.parquet"
    path.parent.mkdir(exist_ok=True)
    pq.write_table(table, path, row_group_size=2)
    return path


def test_parquet_records_with_lists_weights_strings_and_nulls(tmp_path):
    write_parquet(tmp_path, parquet_table())
    m = read_manifest("p", tmp_path, layout=PARQUET_LAYOUT)
    assert (m.fmt, m.ids, m.feature_shape, len(m.shards)) == ("parquet", True, (PARQUET_LAYOUT.width,), 2)
    x = np.concatenate([read_shard(m, s)[0] for s in m.shards])
    assert np.concatenate([read_shard(m, s)[1] for s in m.shards]).tolist() == [0, 1, 1, 0]
    dense, ids, weights = PARQUET_LAYOUT.unpack_numpy(x)
    assert dense[:, 0].tolist() == [0.5, 1.0, 2.0, -3.0]  # as stored: no transform for parquet
    (c1, n1), (c2, n2), (c3, n3), (c4, n4) = ids
    assert c1.tolist() == [5, MISSING_ID, 7, 2**40] and n1.tolist() == [1, 1, 1, 1]
    assert c2.tolist() == [1, 2, MISSING_ID, 3] and n2.tolist() == [2, 0, 1, 1]  # [] empty; null -> MISSING_ID
    assert weights[1].tolist() == [0.5, 2.0, 1.0, 1.5]
    a, cafe, xx, yy = hash64(["a", "café", "x", "y"]).tolist()
    assert c3.tolist() == [a, MISSING_ID, cafe, a] and n3.tolist() == [1, 1, 1, 1]
    assert c4.tolist() == [xx, yy, xx, MISSING_ID] and n4.tolist() == [2, 1, 0, 1]
    # What a model gets: EmbeddingBag input for the weighted multi-hot column.
    i2, o2, w2 = PARQUET_LAYOUT.unpack(torch.from_numpy(x)).features["C2"]
    assert i2.tolist() == [1, 2, 0, 3] and o2.tolist() == [0, 2, 2, 3] and w2.tolist() == [0.5, 2.0, 1.0, 1.5]


@pytest.mark.parametrize(("change", "message"), [
    ({"C2": [[1, 2], [], None, [3, 4, 5]], "C2_weights": [[0.5, 2.0], [], None, [1.0, 1.0, 1.0]]},
     r"row 3: C2: 3 ids, more than the column's max_ids 2"),
    ({"C1": [5, None, -4, 1]}, r"row 2: C1: id -4 is negative"),
    ({"C2_weights": [[0.5, 2.0], [1.0], None, [1.5]]}, r"row 1: C2_weights: 1 weight\(s\) for 0 id\(s\) in 'C2'"),
    ({"d1": [0.5, 1.0, float("nan"), 1.0]}, r"row 2: d1: nan \(dense values must be finite\)"),
    ({"d1": [0.5, None, 1.0, 1.0]}, r"row 1: d1: missing"),
])
def test_a_bad_parquet_record_names_file_row_and_column(tmp_path, change, message):
    path = write_parquet(tmp_path, parquet_table(**change))
    m = read_manifest("p", tmp_path, layout=PARQUET_LAYOUT)
    with pytest.raises(BadRecordError, match=f"^{path}: {message}"):
        for s in m.shards:
            read_shard(m, s)


def test_parquet_columns_that_cannot_feed_the_layout_are_refused_from_the_header(tmp_path):
    table = parquet_table().drop_columns(["C2_weights"]).set_column(1, "d1", pa.array(["a", "b", "c", "d"]))
    write_parquet(tmp_path, table)
    with pytest.raises(ShardError, match=r"part-0.parquet: dense column 'd1' is string, not numeric; weighted column "
                                         r"'C2' needs its weights in a column 'C2_weights'"):
        read_manifest("p", tmp_path, layout=PARQUET_LAYOUT)
    with pytest.raises(ShardError, match="reads Criteo .tsv/.tsv.gz files or parquet files, not csv"):
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "a.csv").write_text("label,x\n1,2\n")
        read_manifest("c", tmp_path, layout=PARQUET_LAYOUT)


# ---------------------------------------------------------------- the generator


def test_the_generator_is_deterministic_for_a_seed(tmp_path):
    a = generate(tmp_path / "a", 3000, files=2, seed=5, multi_hot=2, max_ids=3)
    b = generate(tmp_path / "b", 3000, files=2, seed=5, multi_hot=2, max_ids=3)
    c = generate(tmp_path / "c", 3000, files=2, seed=6, multi_hot=2, max_ids=3)
    assert [p.name for p in a] == ["part-00000.tsv.gz", "part-00001.tsv.gz"]
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(a, b, strict=True))
    assert a[0].read_bytes() != c[0].read_bytes()
    assert sum(count_lines(str(p)) for p in a) == 3000


def test_the_generator_keeps_each_features_cardinality_and_shape(tmp_path):
    scale = 1e-4
    (path,) = generate(tmp_path / "g", 8000, seed=1, scale=scale, multi_hot=3, max_ids=4, gzip=False)
    assert path.name == "part-00000.tsv"
    table = pa.csv.read_csv(path, read_options=pa.csv.ReadOptions(column_names=list(CRITEO_COLUMNS)),
                            parse_options=pa.csv.ParseOptions(delimiter="\t"),
                            convert_options=pa.csv.ConvertOptions(column_types={c: pa.string() for c in
                                                                                CRITEO_COLUMNS[14:]}))
    cards = cardinalities(scale)
    assert cards[0] == round(CRITEO_1TB_CARDINALITIES[0] * scale) and cards[5] == 2  # at least 2
    reached = 0
    for f, name in enumerate(CRITEO_COLUMNS[14:]):
        fields = table.column(name).to_pylist()
        tokens = [t for v in fields if v for t in v.split(",")]
        assert all(len(t) == 8 for t in tokens), name  # 8 hex digits, like Criteo's
        distinct = len(set(tokens))
        assert distinct <= cards[f], (name, distinct, cards[f])
        reached += distinct == cards[f]
        lengths = np.array([len(v.split(",")) for v in fields if v])
        assert lengths.max() == (4 if f < 3 else 1) and lengths.min() == 1, name
        assert 0.01 < fields.count("") / len(fields) < 0.06, name  # ~3% empty
    assert reached >= 5  # the small features reach their bound: it is not vacuous
    dense = np.stack([table.column(f"I{i}").to_numpy(zero_copy_only=False) for i in range(1, 14)])
    assert 0.03 < np.isnan(dense).mean() < 0.07 and np.nanmin(dense) < 0  # ~5% empty, some negative
    assert 0.2 < table.column("label").to_numpy().mean() < 0.3  # ~25% positive


def test_the_generated_label_is_learnable_from_the_unpacked_features(tmp_path):
    """A logistic regression on hashed one-hot ids (EmbeddingBags fed by unpack) and the dense
    values beats always predicting 0 on held-out rows."""
    (path,) = generate(tmp_path / "g", 20000, seed=3, scale=1e-4, multi_hot=2, max_ids=3)
    layout = criteo_layout(max_ids={"C1": 3, "C2": 3})
    x, y = read_criteo(path, layout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny ops: threads only contend)
    try:
        torch.manual_seed(0)
        buckets = 1 << 12
        bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(buckets, 1, mode="mean") for _ in layout.categorical)
        for bag in bags:
            torch.nn.init.zeros_(bag.weight)
        linear = torch.nn.Linear(len(layout.dense), 1)
        opt = torch.optim.Adam([*bags.parameters(), *linear.parameters()], lr=0.05)
        xs, ys, train = torch.from_numpy(x), torch.from_numpy(y), 16000

        def logits(batch: torch.Tensor) -> torch.Tensor:
            r = layout.unpack(batch)
            out = linear(r.dense).squeeze(1)
            for bag, col in zip(bags, layout.categorical, strict=True):
                ids, offsets, _ = r.features[col.name]
                out = out + bag(ids % buckets, offsets).squeeze(1)
            return out

        for _epoch in range(2):
            for idx in torch.randperm(train).split(1000):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(xs[idx]), ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            accuracy = ((logits(xs[train:]) > 0).float() == ys[train:]).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    majority = 1 - ys[train:].mean().item()
    assert 0.7 < majority < 0.8 and accuracy > majority + 0.03, (accuracy, majority)


def test_the_generator_command_line(tmp_path, capsys):
    from examples.make_criteo_like import main

    main(["--out", str(tmp_path / "o"), "--rows", "50", "--files", "2", "--no-gzip", "--multi-hot", "1",
          "--max-ids", "2", "--scale", "0.0001"])
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["part-00000.tsv", "part-00001.tsv"]
    assert "50 lines in 2 file(s)" in capsys.readouterr().out
    m = read_manifest("o", tmp_path, layout=criteo_layout(max_ids={"C1": 2}))
    assert m.rows == 50
