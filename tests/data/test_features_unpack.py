"""RecordLayout.unpack over neighbouring columns of one max_ids and weightedness (unpacked as one
block of the batch): each column's ids, offsets and weights stay its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.data.features import CategoricalColumn, RecordLayout


@pytest.mark.parametrize("strided", [False, True])
def test_unpack_runs_of_alike_columns_match_numpy(strided):
    """Fails if a block's columns are interleaved (row-major instead of column by column), a weighted
    run borrows an unweighted run's slots, or counts cross a column boundary. ``strided``: a batch
    that is a column-major copy (not a view of contiguous rows)."""
    rng = np.random.default_rng(2)
    spec = [(1, False)] * 3 + [(3, True)] * 2 + [(3, False)] * 2 + [(1, True)] * 2 + [(2, False)]
    cols = tuple(CategoricalColumn(f"C{i}", m, weighted=w) for i, (m, w) in enumerate(spec))
    layout = RecordLayout(("I1", "I2"), cols)
    n = 37
    ids, weights = [], []
    for c in cols:
        lengths = rng.integers(0, c.max_ids + 1, n)
        ids.append((rng.integers(0, 2**40, int(lengths.sum())), lengths))
        weights.append(rng.standard_normal(int(lengths.sum())).astype(np.float32) if c.weighted else None)
    x = torch.from_numpy(layout.pack(rng.standard_normal((n, 2)).astype(np.float32), ids, weights))
    if strided:
        x = x.t().contiguous().t()
    want_dense, want_ids, want_weights = layout.unpack_numpy(x.numpy())
    r = layout.unpack(x)
    assert torch.equal(r.dense, torch.from_numpy(want_dense))
    for c, (v, lengths), w in zip(cols, want_ids, want_weights, strict=True):
        got_ids, got_off, got_w = r.features[c.name]
        assert got_ids.tolist() == v.tolist(), c.name
        assert got_off.tolist() == (np.cumsum(lengths) - lengths).tolist(), c.name
        assert (got_w is None) == (w is None) and (w is None or got_w.tolist() == w.tolist()), c.name
