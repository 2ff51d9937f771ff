"""The train/test split of an in-memory dataset: scikit-learn's ``train_test_split`` (shuffled,
stratified by class where every class can be), computed here with numpy alone.

Importing scikit-learn costs about 1.5 s (scipy with it), in the chief and again in every worker
process, at every start. The split is the same, index for index, as
``train_test_split(arange(n), test_size=f, random_state=seed, stratify=y or None)``: the same
``RandomState`` draws in the same order (``ShuffleSplit`` / ``StratifiedShuffleSplit`` with
``_approximate_mode``); ``tests/data/test_split.py`` compares the two.
"""

from __future__ import annotations

import math

import numpy as np


def split_indices(n: int, y: np.ndarray | None, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of ``n`` examples, each sorted; stratified by ``y`` when given."""
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    rng = np.random.RandomState(seed)
    if y is None:
        perm = rng.permutation(n)
        return np.sort(perm[n_test:n_test + n_train]), np.sort(perm[:n_test])
    _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(class_counts)):
        members = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i]: n_i[i] + t_i[i]])
    return np.sort(rng.permutation(train)), np.sort(rng.permutation(test))


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """The most likely per-class counts of ``n_draws`` draws, ties broken by ``rng``."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)
