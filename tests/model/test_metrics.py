"""The merged AUC against scikit-learn's exact one."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from dtrain.model.metrics import AucHistogram


def test_auc_accumulated_over_batches_equals_the_exact_auc():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    logits = rng.normal(size=5000) + 1.2 * y  # informative, far from perfect
    auc = AucHistogram()
    for i in range(0, 5000, 700):  # uneven batches, as shards and eval batches come
        auc.add(torch.from_numpy(logits[i:i + 700]).float().reshape(-1, 1), torch.from_numpy(y[i:i + 700]).float())
    exact = roc_auc_score(y, logits)
    assert abs(auc.value() - exact) < 1e-4
    assert 0.7 < exact < 0.9  # (the case is neither trivial nor perfect)


def test_auc_of_ties_and_of_one_class():
    auc = AucHistogram()
    auc.add(torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 1.0]))  # every score tied: chance
    assert auc.value() == 0.5
    only = AucHistogram()
    only.add(torch.ones(3), torch.ones(3))
    assert only.value() is None  # undefined without negatives, not 0 or 1
