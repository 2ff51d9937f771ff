"""A vectorised hash map from 64-bit ids to row slots: the index of a table without a vocabulary
on one ps task (``dtrain.ps.dynamic``).

Open addressing with linear probing over numpy arrays, every operation on a whole batch of ids at
once (a probe round is one fancy-index over the ids still looking), so a step's thousands of ids
cost a few array passes, not a Python loop per id. Removed ids leave tombstones; the map is rebuilt
(live ids only, at twice their number) once live ids and tombstones fill half of it. Ids are
non-negative int64 (``EMPTY`` and ``TOMB`` are negative). Pure numpy.
"""

from __future__ import annotations

import numpy as np

from dtrain.model.ids import mix64

EMPTY = -1
TOMB = -2
MIN_CAPACITY = 1 << 10


class IdMap:
    """ids (non-negative int64) -> slots (int64), see the module docstring."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cap = MIN_CAPACITY
        while cap < capacity:
            cap <<= 1
        self.keys = np.full(cap, EMPTY, dtype=np.int64)
        self.vals = np.zeros(cap, dtype=np.int64)
        self.size = 0  # live ids
        self.used = 0  # live ids and tombstones

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids) & np.uint64(self.capacity - 1)).astype(np.int64)

    def _probe(self, ids: np.ndarray) -> np.ndarray:
        """Each id's position: where it is, else -1."""
        mask = self.capacity - 1
        pos = self._home(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        active = np.arange(len(ids))
        while len(active):
            k = self.keys[pos[active]]
            hit = k == ids[active]
            out[active[hit]] = pos[active[hit]]
            go = ~hit & (k != EMPTY)
            active = active[go]
            pos[active] = (pos[active] + 1) & mask
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        ids = np.asarray(ids, dtype=np.int64)
        where = self._probe(ids)
        return np.where(where >= 0, self.vals[np.maximum(where, 0)], -1)

    def put(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add ``ids`` (unique, absent) with their ``slots``."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        if (self.used + len(ids)) * 2 > self.capacity:
            self._rebuild(2 * (self.size + len(ids)))
        mask = self.capacity - 1
        pos = self._home(ids)
        active = np.arange(len(ids))
        while len(active):
            free = self.keys[pos[active]] == EMPTY
            cand = active[free]
            # several ids may reach one empty position in a round: the first of each takes it
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[first]
            self.keys[pos[won]] = ids[won]
            self.vals[pos[won]] = slots[won]
            taken = np.zeros(len(ids), dtype=bool)
            taken[won] = True
            active = active[~taken[active]]
            pos[active] = (pos[active] + 1) & mask
        self.size += len(ids)
        self.used += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        """Drop ``ids`` (absent ones are ignored)."""
        where = self._probe(np.asarray(ids, dtype=np.int64))
        where = where[where >= 0]
        self.keys[where] = TOMB
        self.size -= len(where)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every live entry, in position order."""
        live = self.keys >= 0
        return self.keys[live].copy(), self.vals[live].copy()

    def _rebuild(self, capacity: int) -> None:
        ids, slots = self.items()
        self._alloc(max(capacity, 2 * len(ids)))
        self.put(ids, slots)
