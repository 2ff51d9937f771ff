"""64-bit ids of tables without a vocabulary: which ps task holds an id, and the row it starts
with. Both are pure functions of the id (and the run's seed and the table's name), so a row's
home and initial value never depend on the number of ps tasks or on the order ids arrive in.

- ``mix64``: SplitMix64's finaliser (Steele, Lea and Flood, 2014), a bijection of 64-bit words
  whose output bits each depend on every input bit; a dynamic table's id lives on ps task
  ``mix64(id) % num_ps`` (docs/recommendation.md).
- ``id_rows``: the initial row of each id, uniform with standard deviation ``std``: per element,
  24 bits of ``mix64`` of (seed, table, id, element).

Pure numpy/torch: no Dask.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 words (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mix64(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """The mixed 64-bit word of each (int64) id, as uint64."""
    words = (ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)).astype(np.int64, copy=False)
    with np.errstate(over="ignore"):
        return _mix(words.view(np.uint64))


def home_part(ids: torch.Tensor, num_parts: int) -> torch.Tensor:
    """The ps task (0 .. num_parts - 1) that holds each id of a dynamic table."""
    return torch.from_numpy((mix64(ids.cpu()) % np.uint64(num_parts)).astype(np.int64))


def table_key(seed: int, name: str) -> np.uint64:
    """A word that separates the initial rows of two tables, or of one table under two seeds."""
    with np.errstate(over="ignore"):
        return _mix(np.array([int(seed) & (2**64 - 1)], np.uint64) * _GOLDEN
                    + np.uint64(zlib.crc32(name.encode())))[0]


ID_BLOCK = 2048
"""Ids drawn per block in :func:`id_rows` (a block's temporaries stay in the CPU's cache: about 10x
faster than one pass over a large table's ids)."""


def _mix_(z: np.ndarray) -> np.ndarray:
    """:func:`_mix` in place."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def id_rows(seed: int, name: str, ids: np.ndarray | torch.Tensor, dim: int, std: float) -> torch.Tensor:
    """The initial rows (float32, (len(ids), dim)) of ``ids`` in table ``name``: uniform with
    standard deviation ``std`` (over [-sqrt(3) std, sqrt(3) std], in steps of 2**-24 of that range),
    element ``j`` of id ``i`` from the top 24 bits of ``mix64(mix64(i ^ key) + (j + 1) * golden)``, where
    ``key`` mixes the seed and the table's name: a function of (seed, name, id, element) only."""
    words = (ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)).astype(np.int64, copy=False)
    key = table_key(seed, name)
    lanes = np.arange(1, dim + 1, dtype=np.uint64) * _GOLDEN
    bound = math.sqrt(3.0) * std
    out = np.empty((len(words), dim), dtype=np.float32)
    with np.errstate(over="ignore"):
        for lo in range(0, len(words), ID_BLOCK):
            base = _mix_(words[lo:lo + ID_BLOCK].view(np.uint64) ^ key)
            z = _mix_(base[:, None] + lanes[None, :])
            block = out[lo:lo + ID_BLOCK]
            np.copyto(block, z >> np.uint64(40), casting="unsafe")
    out *= np.float32(2.0 * bound / (1 << 24))
    out -= np.float32(bound)
    return torch.from_numpy(out)
