"""The record codec: packing recommendation records into int64 rows and unpacking them into what
``nn.EmbeddingBag`` takes; the string hash and the dense transform."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from dtrain.data.features import (
    MISSING_ID,
    PAD,
    CategoricalColumn,
    LayoutError,
    RecordLayout,
    dense_transform,
    hash64,
)

LAYOUT = RecordLayout(("I1", "I2"), (CategoricalColumn("C1"), CategoricalColumn("C2", 3),
                                     CategoricalColumn("C3", 2, weighted=True)))


def example() -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]], list[np.ndarray | None]]:
    """Four examples: C2 holds an empty list, a full list (3 = max_ids) and a 1-id list; C3 (weighted)
    an empty list and a full one; an id near 2**63 - 1."""
    dense = np.array([[0.5, -1.25], [0.0, 3.0], [1e-30, -0.0], [7.0, 2.5]], dtype=np.float32)
    c1 = (np.array([5, MISSING_ID, 2**63 - 1, 9]), np.array([1, 1, 1, 1]))
    c2 = (np.array([10, 11, 12, 13, 40]), np.array([0, 3, 1, 1]))
    c3 = (np.array([7, 8, 7, 1, 2]), np.array([2, 0, 1, 2]))
    w3 = np.array([0.5, 2.0, -1.0, 1.5, 0.25], dtype=np.float32)
    return dense, [c1, c2, c3], [None, None, w3]


def test_width_counts_dense_id_and_weight_slots():
    assert LAYOUT.width == 2 + (1 + 3 + 2) + 2
    assert RecordLayout((), (CategoricalColumn("C1", 4),)).width == 4


def test_pack_places_dense_bits_ids_then_pad_then_weights():
    dense, ids, weights = example()
    x = LAYOUT.pack(dense, ids, weights)
    assert x.dtype == np.int64 and x.shape == (4, LAYOUT.width)
    # Dense as float32 bits (a wrong view, e.g. a cast to int, would give 0 for 0.5).
    assert x[0, 0] == np.float32(0.5).view(np.int32) and x[0, 1] == np.float32(-1.25).view(np.int32)
    assert list(x[:, 2]) == [5, MISSING_ID, 2**63 - 1, 9]
    # C2's slots: an empty list is all PAD, a full list has none, a short one PAD after its ids.
    assert x[0, 3:6].tolist() == [PAD] * 3 and x[1, 3:6].tolist() == [10, 11, 12] and x[2, 3:6].tolist() == [13, PAD, PAD]
    # C3's ids then, after every id slot, its weights (0 after the example's own).
    assert x[0, 6:8].tolist() == [7, 8] and x[1, 6:8].tolist() == [PAD, PAD]
    assert x[0, 8:10].astype(np.int32).view(np.float32).tolist() == [0.5, 2.0]
    assert x[1, 8:10].tolist() == [0, 0]


def test_round_trip_numpy_and_torch():
    dense, ids, weights = example()
    x = LAYOUT.pack(dense, ids, weights)
    d2, ids2, w2 = LAYOUT.unpack_numpy(x)
    assert np.array_equal(d2.view(np.int32), dense.view(np.int32))  # bit-exact: -0.0 and 1e-30 survive
    for (v, n), (v2, n2) in zip(ids, ids2, strict=True):
        assert v2.tolist() == v.tolist() and n2.tolist() == n.tolist()
    assert w2[0] is None and w2[1] is None and w2[2].tolist() == weights[2].tolist()
    assert np.array_equal(LAYOUT.pack(d2, ids2, w2), x)

    r = LAYOUT.unpack(torch.from_numpy(x))
    assert r.dense.dtype == torch.float32 and torch.equal(r.dense, torch.from_numpy(dense))
    assert set(r.features) == {"C1", "C2", "C3"}
    i1, o1, w1 = r.features["C1"]
    assert i1.tolist() == [5, 0, 2**63 - 1, 9] and o1.tolist() == [0, 1, 2, 3] and w1 is None
    i2, o2, _ = r.features["C2"]
    assert i2.tolist() == [10, 11, 12, 13, 40] and o2.tolist() == [0, 0, 3, 4]  # example 0 is empty
    i3, o3, w3 = r.features["C3"]
    assert i3.tolist() == [7, 8, 7, 1, 2] and o3.tolist() == [0, 2, 2, 3]
    assert w3 is not None and w3.dtype == torch.float32 and w3.tolist() == weights[2].tolist()
    assert all(t.dtype == torch.int64 for i, o, _ in r.features.values() for t in (i, o))


def test_unpacked_columns_feed_embedding_bag_like_hand_built_ones():
    """The unpacked (ids, offsets, weights) give the same bag sums as the hand-written CSR input."""
    torch.manual_seed(0)
    dense, ids, weights = example()
    ids[0] = (ids[0][0] % 50, ids[0][1])  # table rows
    r = LAYOUT.unpack(torch.from_numpy(LAYOUT.pack(dense, ids, weights)))
    bag = torch.nn.EmbeddingBag(50, 4, mode="sum")
    for i, c in enumerate(LAYOUT.categorical):
        values, lengths = ids[i]
        want_ids = torch.as_tensor(values, dtype=torch.int64)
        want_off = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)[:-1]]), dtype=torch.int64)
        want_w = torch.as_tensor(weights[i]) if weights[i] is not None else None
        got_ids, got_off, got_w = r.features[c.name]
        want = bag(want_ids, want_off, per_sample_weights=want_w)
        got = bag(got_ids, got_off, per_sample_weights=got_w)
        assert got.shape == (4, 4) and torch.equal(got, want), c.name
    assert torch.count_nonzero(bag(*r.features["C2"][:2])[0]) == 0  # the empty bag sums to zero


def test_unpack_a_large_random_batch_matches_numpy():
    rng = np.random.default_rng(1)
    cols = tuple(CategoricalColumn(f"C{i}", m, weighted=i % 3 == 0) for i, m in enumerate([1, 1, 5, 2, 1, 8, 1]))
    layout = RecordLayout(tuple(f"I{i}" for i in range(13)), cols)
    n = 1024
    ids, weights = [], []
    for c in cols:
        lengths = rng.integers(0 if c.max_ids > 1 else 1, c.max_ids + 1, n)
        ids.append((rng.integers(0, 2**62, int(lengths.sum())), lengths))
        weights.append(rng.standard_normal(int(lengths.sum())).astype(np.float32) if c.weighted else None)
    x = layout.pack(rng.standard_normal((n, 13)).astype(np.float32), ids, weights)
    r = layout.unpack(torch.from_numpy(x))
    for c, (v, lengths), w in zip(cols, ids, weights, strict=True):
        got_ids, got_off, got_w = r.features[c.name]
        assert got_ids.tolist() == v.tolist(), c.name
        assert got_off.tolist() == (np.cumsum(lengths) - lengths).tolist(), c.name
        assert (got_w is None) == (w is None) and (w is None or got_w.tolist() == w.tolist()), c.name


def test_an_all_empty_column_unpacks_to_no_ids():
    layout = RecordLayout((), (CategoricalColumn("C1", 2), CategoricalColumn("C2")))
    x = layout.pack(np.zeros((3, 0), np.float32), [(np.array([], np.int64), np.zeros(3, np.int64)),
                                                   (np.array([4, 5, 6]), np.ones(3, np.int64))])
    r = layout.unpack(torch.from_numpy(x))
    assert r.features["C1"][0].numel() == 0 and r.features["C1"][1].tolist() == [0, 0, 0]
    assert r.features["C2"][0].tolist() == [4, 5, 6] and r.dense.shape == (3, 0)


def test_pack_names_the_column_and_first_row_of_a_list_too_long():
    dense, ids, weights = example()
    ids[1] = (np.arange(8), np.array([1, 2, 4, 1]))  # row 2: 4 ids, max_ids 3
    with pytest.raises(LayoutError, match=r"^C2: row 2: 4 ids, more than the column's max_ids 3$") as e:
        LAYOUT.pack(dense, ids, weights)
    assert (e.value.column, e.value.row) == ("C2", 2)


def test_pack_names_the_column_and_row_of_a_negative_id():
    dense, ids, weights = example()
    ids[2] = (np.array([7, 8, 7, 1, -3]), ids[2][1])  # the 5th id belongs to row 3
    with pytest.raises(LayoutError, match=r"^C3: row 3: id -3 is negative"):
        LAYOUT.pack(dense, ids, weights)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d, i, w: (d, i, [None, None, None]), "C3: the column is weighted: give its weights"),
    (lambda d, i, w: (d, i, [np.ones(4, np.float32), None, w[2]]), "C1: weights given for a column that is not"),
    (lambda d, i, w: (d, [i[0], (i[1][0][:4], i[1][1]), i[2]], w), "C2: lengths add up to 5, but 4 ids"),
    (lambda d, i, w: (d[:, :1], i, w), r"dense values must be \(N, 2\)"),
    (lambda d, i, w: (d, i[:2], w), "one \\(values, lengths\\) pair per categorical column"),
])
def test_pack_refuses_inconsistent_input(change, message):
    with pytest.raises(ValueError, match=message):
        LAYOUT.pack(*change(*example()))


def test_pack_refuses_a_negative_length_and_an_unsigned_id_above_int64():
    dense, ids, weights = example()
    ids[1] = (ids[1][0], np.array([0, 3, 3, -1]))
    with pytest.raises(LayoutError, match=r"^C2: row 3: negative length -1$"):
        LAYOUT.pack(dense, ids, weights)
    dense, ids, weights = example()
    ids[0] = (np.array([5, 0, 2**63, 9], dtype=np.uint64), ids[0][1])
    with pytest.raises(LayoutError, match=r"^C1: row 2: id 9223372036854775808 is above 2\*\*63 - 1$"):
        LAYOUT.pack(dense, ids, weights)


def reference_pack(layout: RecordLayout, dense: np.ndarray, ids: list[tuple[np.ndarray, np.ndarray]],
                   weights: list[np.ndarray | None]) -> np.ndarray:
    """The packed rows built one row and one slot at a time, as the module docstring describes them."""
    n = len(dense)
    out = np.zeros((n, layout.width), np.int64)
    out[:, :len(layout.dense)] = np.asarray(dense, np.float32).view(np.int32)
    slots = layout.slots()
    for c, (values, lengths), w in zip(layout.categorical, ids, weights, strict=True):
        at, m, wat = slots[c.name]
        start = 0
        for r in range(n):
            k = int(lengths[r])
            out[r, at:at + m] = [*values[start:start + k], *[PAD] * (m - k)]
            if wat is not None:
                out[r, wat:wat + k] = np.asarray(w[start:start + k], np.float32).view(np.int32)
            start += k
    return out


@pytest.mark.parametrize("band_bytes", [None, 3 * 8 * 23])  # (the default; bands of 3 rows)
@pytest.mark.parametrize("n", [0, 1, 50])
def test_pack_equals_a_row_by_row_reference_on_random_ragged_input(monkeypatch, n, band_bytes):
    """Full and ragged columns, empty lists, weighted columns, single-id columns and rows packed in
    several bands: the same rows as building each one slot by slot."""
    import dtrain.data.features as features

    if band_bytes is not None:
        monkeypatch.setattr(features, "_BAND_BYTES", band_bytes)
    rng = np.random.default_rng(n)
    cols = (CategoricalColumn("C1"), CategoricalColumn("C2", 4), CategoricalColumn("C3", 3, weighted=True),
            CategoricalColumn("C4", weighted=True), CategoricalColumn("C5", 2), CategoricalColumn("C6", 5))
    layout = RecordLayout(("I1", "I2", "I3"), cols)
    assert layout.width == 23
    ids, weights = [], []
    for c in cols:
        if c.name == "C5":
            lengths = np.full(n, 2)  # every list full: the reshape, not the scatter
        elif c.name == "C6":
            lengths = np.zeros(n, np.int64)  # every list empty
        else:
            lengths = rng.integers(0 if c.max_ids > 1 else 1, c.max_ids + 1, n)
        total = int(lengths.sum())
        ids.append((rng.integers(0, 2**63 - 1, total, dtype=np.int64), lengths))
        weights.append(rng.standard_normal(total).astype(np.float32) if c.weighted else None)
    dense = rng.standard_normal((n, 3)).astype(np.float32)
    x = layout.pack(dense, ids, weights)
    assert x.dtype == np.int64 and x.shape == (n, 23) and x.flags.c_contiguous
    assert np.array_equal(x, reference_pack(layout, dense, ids, weights))
    # Other dtypes of the same values: float64 dense, int32 lengths, uint64 ids, float64 weights.
    other = [(v.astype(np.uint64), lengths.astype(np.int32)) for v, lengths in ids]
    assert np.array_equal(layout.pack(dense.astype(np.float64), other,
                                      [None if w is None else w.astype(np.float64) for w in weights]), x)


def test_unpack_refuses_the_wrong_width_or_dtype():
    with pytest.raises(ValueError, match=r"int64 \(B, 10\)"):
        LAYOUT.unpack(torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"int64 \(B, 10\)"):
        LAYOUT.unpack(torch.zeros(2, 10))


def test_layouts_refuse_repeated_names_and_bad_max_ids():
    with pytest.raises(ValueError, match="repeated: C1"):
        RecordLayout(("C1",), (CategoricalColumn("C1"),))
    with pytest.raises(ValueError, match="C2: max_ids must be an integer >= 1"):
        CategoricalColumn("C2", 0)
    assert hash(LAYOUT) == hash(RecordLayout(("I1", "I2"), LAYOUT.categorical))  # frozen: a cache key


def test_hash64_is_blake2b_little_endian_masked():
    got = hash64(["68fd1e64", "", "café", "68fd1e64"])
    want = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") & (2**63 - 1)
            for s in ["68fd1e64", "", "café"]]
    assert got.dtype == np.int64 and got.tolist() == [want[0], want[1], want[2], want[0]]
    assert (got >= 0).all() and hash64([]).shape == (0,)
    assert hash64(np.array(["café", "x"])).tolist() == hash64(np.array(["café".encode(), b"x"])).tolist()
    with pytest.raises(TypeError, match="hash64 hashes strings, got int 7"):
        hash64(["a", 7])


def test_dense_transform_is_log1p_of_the_positive_part_missing_zero():
    got = dense_transform([0, 1, -5, np.nan, np.e - 1, 1e9])
    assert got.dtype == np.float32
    assert np.allclose(got, [0, np.log(2), 0, 0, 1, np.log1p(1e9)])
