"""Each replica's deterministic order of batches: seeded epoch permutations, sliced so that the
replicas' k-th batches are disjoint and together equal a single process's k-th global batch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


def epoch_permutation(n_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The sample order of ``epoch``: ``default_rng([seed, epoch]).permutation(n)`` (or arange)."""
    if not shuffle:
        return np.arange(n_samples)
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


class ShardIterator:
    """Deterministic batches for replica ``r`` of ``R``, each of ``batch_size`` samples.

    Every epoch is a seeded permutation of all sample indices, the same on every replica.
    Global step ``j`` of an epoch covers positions ``[j*R*b, (j+1)*R*b)`` of that
    permutation -- exactly the batch a single process with batch ``R*b`` sees at step ``j``
    -- and replica ``r`` takes the sub-slice ``[j*R*b + r*b, j*R*b + (r+1)*b)``.  An epoch
    has ``n // (R*b)`` steps (the incomplete tail is dropped); then the next epoch starts
    with a fresh permutation.  So the replicas' ``k``-th batches are disjoint and together
    equal the single-process batch ``k``.
    """

    def __init__(
        self,
        n_samples: int,
        batch_size: int,
        replica_index: int,
        num_replicas: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if num_replicas < 1 or not 0 <= replica_index < num_replicas:
            raise ValueError(f"replica_index must be in [0, {num_replicas}), got {replica_index}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n_samples < batch_size * num_replicas:
            raise ValueError(
                f"{n_samples} training samples cannot fill one global batch of "
                f"{num_replicas} replicas x {batch_size}; lower batch_size"
            )
        self.n_samples = n_samples
        self.batch_size = batch_size
        self.replica_index = replica_index
        self.num_replicas = num_replicas
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = n_samples // (batch_size * num_replicas)
        self.epoch = 0
        self.position = 0
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    @property
    def local_step(self) -> int:
        """Batches taken so far (over all epochs)."""
        return self.epoch * self.steps_per_epoch + self.position

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.n_samples, self.seed, self.epoch, self.shuffle)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def next_indices(self) -> np.ndarray:
        """Indices of this replica's next batch (``batch_size`` of them), advancing the state."""
        start = (self.position * self.num_replicas + self.replica_index) * self.batch_size
        out = self._permutation()[start : start + self.batch_size].copy()
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        return self.next_indices()

    def seek(self, local_step: int) -> None:
        """Position the iterator as if ``local_step`` batches had been taken."""
        if local_step < 0:
            raise ValueError(f"local_step must be >= 0, got {local_step}")
        self.epoch, self.position = divmod(int(local_step), self.steps_per_epoch)

    def state(self) -> dict[str, int]:
        """Resumable state as plain ints: ``{"epoch", "position"}``."""
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state(self, state: Mapping[str, int]) -> None:
        """Restore a :meth:`state` dict (from this or an identically configured iterator)."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(
                f"invalid iterator state {dict(state)} for {self.steps_per_epoch} steps per epoch"
            )
        self.epoch, self.position = epoch, position

    @staticmethod
    def global_batch_indices(
        step: int, global_batch: int, *, n_samples: int, seed: int, shuffle: bool = True
    ) -> np.ndarray:
        """Indices a single-process loop with batch ``global_batch`` sees at (0-based) ``step``."""
        steps_per_epoch = n_samples // global_batch
        if steps_per_epoch < 1:
            raise ValueError(f"{n_samples} samples cannot fill a batch of {global_batch}")
        epoch, j = divmod(step, steps_per_epoch)
        perm = epoch_permutation(n_samples, seed, epoch, shuffle)
        return perm[j * global_batch : (j + 1) * global_batch].copy()
