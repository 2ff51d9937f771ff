"""dtrain.data.split gives scikit-learn's train_test_split, index for index, without importing
scikit-learn: the split every pipeline's accuracy was measured with stays the same."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from dtrain.data.sources import _bundled_digits, _split
from dtrain.data.split import split_indices

RNG = np.random.default_rng(7)
LABELS = {
    "digits": load_digits(return_X_y=True)[1],
    "balanced": np.arange(150) % 3,
    "imbalanced": np.array([0] * 90 + [1] * 7 + [2] * 3),
    "ties": np.repeat([0, 1, 2, 3], [5, 5, 5, 4]),
    "random": RNG.integers(0, 5, size=333),
}


@pytest.mark.parametrize("labels", LABELS, ids=list(LABELS))
@pytest.mark.parametrize("fraction", [0.2, 0.25, 0.4])
@pytest.mark.parametrize("seed", [0, 1, 42])
def test_stratified_split_is_sklearns(labels, fraction, seed):
    y = LABELS[labels]
    n = len(y)
    want_train, want_test = train_test_split(np.arange(n), test_size=fraction, random_state=seed, stratify=y)
    train, test = split_indices(n, y, fraction, seed)
    assert np.array_equal(train, np.sort(want_train)) and np.array_equal(test, np.sort(want_test))


@pytest.mark.parametrize(("n", "fraction", "seed"), [(10, 0.2, 0), (1797, 0.2, 0), (442, 0.25, 3), (7, 0.5, 9)])
def test_plain_split_is_sklearns(n, fraction, seed):
    want_train, want_test = train_test_split(np.arange(n), test_size=fraction, random_state=seed)
    train, test = split_indices(n, None, fraction, seed)
    assert np.array_equal(train, np.sort(want_train)) and np.array_equal(test, np.sort(want_test))


@pytest.mark.parametrize("labels", [
    np.array([0] * 30 + [1] * 29 + [2]),  # a class of one example
    np.arange(20) % 10,  # 10 classes, 4 test examples
], ids=["singleton-class", "more-classes-than-test-examples"])
def test_a_split_that_cannot_be_stratified_is_sklearns_plain_one(labels):
    """Labels scikit-learn cannot stratify (it raises): the dataset's split is then the plain,
    unstratified one, index for index (fails if dtrain stratified anyway or raised)."""
    n = len(labels)
    with pytest.raises(ValueError):
        train_test_split(np.arange(n), test_size=0.2, random_state=5, stratify=labels)
    want_train, want_test = train_test_split(np.arange(n), test_size=0.2, random_state=5)
    train, test = _split(n, labels, "classification", 0.2, 5)
    assert np.array_equal(train, np.sort(want_train)) and np.array_equal(test, np.sort(want_test))


def test_digits_load_and_split_without_importing_sklearn():
    x, y = _bundled_digits()
    want_x, want_y = load_digits(return_X_y=True)
    assert np.array_equal(x, want_x) and x.dtype == want_x.dtype
    assert np.array_equal(y, want_y) and y.dtype == want_y.dtype
    code = ("import sys; from dtrain.data.sources import load_dataset; load_dataset('sklearn:digits'); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
