"""Non-finite values in data files are refused when the data is loaded (review M9), naming the
file, the row and the column: one NaN or inf would spread over its column when standardised and
turn every update into NaN. The chief loads the data before start (`plan`, `run`), and every
replica loads it with the same function."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtrain.data.sources import load_dataset


def _xy(n: int = 40, features: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, features)), np.arange(n) % 2


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_npz_with_non_finite_x_is_rejected(tmp_path: Path, bad: float):
    x, y = _xy()
    x[7, 2] = bad
    x[9, 0] = bad
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with pytest.raises(ValueError, match=rf"d\.npz: x\[7, 2\] is {bad} \(row 7, column 2; 2 non-finite value\(s\) "
                                         r"in 'x'\); data files must hold finite numbers"):
        load_dataset("d.npz", base_dir=tmp_path)


def test_npz_images_name_the_flat_column(tmp_path: Path):
    x = np.zeros((10, 1, 4, 4), dtype=np.float32)
    x[3, 0, 2, 1] = np.nan
    np.savez(tmp_path / "img.npz", x=x, y=np.arange(10) % 2)
    with pytest.raises(ValueError, match=r"x\[3, 0, 2, 1\] is nan \(row 3, column 9;"):
        load_dataset("img.npz", base_dir=tmp_path)


def test_npz_regression_target_with_inf_is_rejected(tmp_path: Path):
    x, _ = _xy()
    y = np.linspace(0, 1, len(x))
    y[11] = np.inf
    np.savez(tmp_path / "r.npz", x=x, y=y)
    with pytest.raises(ValueError, match=r"r\.npz: y\[11\] is inf \(row 11; 1 non-finite"):
        load_dataset("r.npz", base_dir=tmp_path, task="regression")


def test_csv_with_inf_cell_is_rejected(tmp_path: Path):
    x, y = _xy()
    lines = ["f0,f1,label"] + [f"{a},{b},{c}" for (a, b, _), c in zip(x, y, strict=True)]
    lines[4] = lines[4].split(",", 1)[0] + ",inf," + lines[4].rsplit(",", 1)[1]  # data row 3: line 5
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d\.csv: row 3 \(line 5\), column 'f1' is inf \(1 non-finite"):
        load_dataset("d.csv", base_dir=tmp_path)


def test_csv_regression_target_with_inf_is_rejected(tmp_path: Path):
    lines = ["a,b,label"] + [f"{i},{i * 2},{i / 10}" for i in range(20)]
    lines[12] = "11,22,-inf"
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"row 11 \(line 13\), column 'label' is -inf"):
        load_dataset("r.csv", base_dir=tmp_path)


def test_parquet_with_nan_cell_is_rejected(tmp_path: Path):
    x, y = _xy()
    x[20, 1] = np.nan  # a float NaN, not a null: parquet keeps them apart
    pq.write_table(pa.table({"a": x[:, 0], "b": pa.array(x[:, 1], from_pandas=False), "label": y}),
                   tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet: row 20, column 'b' is nan"):
        load_dataset("d.parquet", base_dir=tmp_path)


def test_finite_files_and_generated_sources_load():
    assert np.isfinite(load_dataset("synthetic", num_samples=64).x_train).all()
    assert np.isfinite(load_dataset("sklearn:digits").x_train).all()
