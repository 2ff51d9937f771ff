"""Small sharded datasets for the streaming tests: parquet, CSV or npz files whose first feature
``sample_id`` is each row's global index (so tests can count which samples were consumed) and whose
label is learnable from the other features."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq


def rows_of(n: int, start: int, seed: int, features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, features, labels) of ``n`` rows from global index ``start``."""
    rng = np.random.default_rng([seed, start])
    y = rng.integers(0, 2, n)
    x = rng.standard_normal((n, features - 1)) + 2.0 * (2 * y[:, None] - 1)
    return np.arange(start, start + n, dtype=np.float64), x, y


def write(directory: Path, rows: list[int], fmt: str = "parquet", features: int = 4, row_group: int | None = None,
          seed: int = 0, start: int = 0) -> list[Path]:
    """One file per entry of ``rows`` (parquet with ``row_group`` rows per group); ids from ``start``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(rows):
        ids, x, y = rows_of(n, start, seed, features)
        start += n
        path = directory / f"part-{i:03d}.{fmt}"
        if fmt == "npz":
            np.savez(path, x=np.column_stack([ids, x]).astype(np.float32), y=y)
        else:
            table = pa.table({"sample_id": ids, **{f"f{j}": x[:, j] for j in range(features - 1)}, "label": y})
            if fmt == "csv":
                pacsv.write_csv(table, path)
            else:
                pq.write_table(table, path, row_group_size=row_group or max(n, 1))
        paths.append(path)
    return paths
