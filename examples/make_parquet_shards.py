"""Write a seeded, multi-file synthetic parquet dataset of a chosen size (pipelines/stream_parquet.yaml).

Each sample has ``--features`` float32 columns ``f0..`` and an int64 ``label``: Gaussian blobs
around ``--classes`` seeded centroids (unit noise, centroids about 4 apart: learnable to well over
90% accuracy by a small MLP). Files ``part-00000.parquet``... each hold ``--row-group`` rows per
parquet row group (the unit dtrain assigns to replicas). ``--id-column`` adds a float column
``sample_id`` holding each row's global index (tests count which samples training consumed).

    python examples/make_parquet_shards.py --out data/stream --rows 200000 --files 8
    python examples/make_parquet_shards.py --out data/big --size-gb 2   # rows from the size

The same arguments always write the same data (the seed, and one generator per file).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def centroids(features: int, classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal((classes, features)) * (3.0 / math.sqrt(features)) * 1.5


def write_shards(out: str | Path, rows: int, files: int = 8, features: int = 32, classes: int = 4,
                 row_group: int = 8192, seed: int = 0, id_column: bool = False) -> list[Path]:
    """Write the dataset; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    centers = centroids(features, classes, seed)
    per_file = [rows // files + (1 if i < rows % files else 0) for i in range(files)]
    paths, start = [], 0
    for i, n in enumerate(per_file):
        rng = np.random.default_rng([seed, 1, i])
        y = rng.integers(0, classes, n)
        x = (centers[y] + rng.standard_normal((n, features))).astype(np.float32)
        columns = {}
        if id_column:
            columns["sample_id"] = np.arange(start, start + n, dtype=np.float64)
        columns.update({f"f{j}": x[:, j] for j in range(features)})
        columns["label"] = y.astype(np.int64)
        path = out / f"part-{i:05d}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.table(columns), tmp, row_group_size=row_group, compression="snappy")
        tmp.replace(path)
        paths.append(path)
        start += n
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write part-*.parquet into")
    p.add_argument("--rows", type=int, default=None, help="samples in all (default 100000, or from --size-gb)")
    p.add_argument("--size-gb", type=float, default=None, help="choose --rows for about this much float32 data")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--row-group", type=int, default=8192, help="rows per parquet row group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--id-column", action="store_true", help="add sample_id (the row's global index)")
    a = p.parse_args(argv)
    rows = a.rows or (int(a.size_gb * 2**30 / (4 * a.features + 8)) if a.size_gb else 100_000)
    paths = write_shards(a.out, rows, a.files, a.features, a.classes, a.row_group, a.seed, a.id_column)
    size = sum(p.stat().st_size for p in paths)
    print(f"wrote {rows} rows in {len(paths)} files ({size / 2**20:.1f} MiB on disk) to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
