"""A seeded generator of synthetic click-through data, for sparse embedding tables.

What it models: each example has ``fields`` categorical features (user, item, ad, site...), each
an id in ``[0, vocab)``. Ids are Zipf-distributed (a few hot ids, a long tail), with a different
random ranking per field, so hot ids differ between fields. Every id has a hidden weight drawn
from normal(0, 1); an example's click logit is the sum of its ids' weights, scaled to unit
variance, plus normal noise (``noise``); the label is 1 where the logit is above 0. So the label
is learnable from the ids alone: an embedding model that learns the hot ids' weights beats the
majority class, and the noise caps the best accuracy below 1.

    python -m dtrain.data.ctr --out ctr.npz --rows 20000 --fields 8 --vocab 100000 --seed 0

writes ``x`` (int32 ids, rows x fields) and ``y`` (int64 0/1) with ``numpy.savez_compressed``,
the layout ``data.source`` reads (docs/sparse.md). Pure numpy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def make_ctr(rows: int, fields: int, vocab: int, seed: int = 0, zipf_a: float = 1.2,
             noise: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """(x int64 (rows, fields) ids in [0, vocab), y int64 0/1), the same for the same arguments."""
    if rows < 1 or fields < 1 or vocab < 2:
        raise ValueError("make_ctr needs rows >= 1, fields >= 1 and vocab >= 2")
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(vocab)
    x = np.empty((rows, fields), dtype=np.int64)
    for f in range(fields):
        rank = (rng.zipf(zipf_a, rows) - 1) % vocab  # 0 is the hottest
        x[:, f] = rng.permutation(vocab)[rank]
    logit = weights[x].sum(axis=1) / np.sqrt(fields) + noise * rng.standard_normal(rows)
    y = (logit > 0).astype(np.int64)
    return x, y


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dtrain.data.ctr", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the .npz file to write")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--vocab", type=int, default=100000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf-a", type=float, default=1.2)
    p.add_argument("--noise", type=float, default=0.5)
    a = p.parse_args(argv)
    x, y = make_ctr(a.rows, a.fields, a.vocab, a.seed, a.zipf_a, a.noise)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, x=x.astype(np.int32 if a.vocab < 2**31 else np.int64), y=y)
    print(f"{a.out}: {a.rows} rows, {a.fields} fields, ids < {a.vocab}, {y.mean():.3f} positive")


if __name__ == "__main__":
    main()
