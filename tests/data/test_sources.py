"""dtrain.data.sources: dataset loading and splitting, file formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtrain.data.sampling import ShardIterator
from dtrain.data.sources import (
    SKLEARN_DATASETS,
    Dataset,
    check_source,
    data_source_kind,
    load_dataset,
    resolve_data_path,
    to_tensors,
)


def test_digits_shapes_classes_and_stratification() -> None:
    d = load_dataset("sklearn:digits", test_fraction=0.2, seed=0)
    assert isinstance(d, Dataset)
    assert d.task == "classification" and d.num_classes == 10 and d.num_features == 64
    assert d.feature_shape == (64,)
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert set(np.unique(d.y_test)) == set(range(10))
    # Stratified: each class's share of the test split matches its share overall.
    full = np.concatenate([d.y_train, d.y_test])
    frac_all = np.bincount(full, minlength=10) / len(full)
    frac_test = np.bincount(d.y_test, minlength=10) / len(d.y_test)
    assert np.abs(frac_all - frac_test).max() < 0.01
    # Standardised with the training split's statistics (constant pixels stay 0).
    std = d.x_train.std(axis=0)
    assert np.abs(d.x_train.mean(axis=0)).max() < 1e-4
    assert np.all((np.abs(std - 1) < 1e-3) | (std == 0))
    assert np.isfinite(d.x_test).all()
    raw = load_dataset("sklearn:digits", standardize=False)
    assert raw.x_train.max() == 16.0 and raw.mean is None
    assert np.allclose((raw.x_test - d.mean) / d.std, d.x_test, atol=1e-5)
    # Seeded split: same seed same split, other seed a different one.
    assert np.array_equal(load_dataset("sklearn:digits", seed=0).y_train, d.y_train)
    assert not np.array_equal(load_dataset("sklearn:digits", seed=1).y_train, d.y_train)


def test_other_sklearn_datasets_and_feature_shape() -> None:
    assert "digits" in SKLEARN_DATASETS
    iris = load_dataset("sklearn:iris")
    assert iris.num_classes == 3 and iris.x_train.shape == (120, 4)
    diabetes = load_dataset("sklearn:diabetes")
    assert diabetes.task == "regression" and diabetes.num_classes is None
    assert diabetes.y_train.dtype == np.float32
    img = load_dataset("sklearn:digits", feature_shape=[1, 8, 8])
    assert img.x_train.shape == (1437, 1, 8, 8) and img.feature_shape == (1, 8, 8)
    assert img.num_features == 64
    with pytest.raises(ValueError, match="feature_shape"):
        load_dataset("sklearn:iris", feature_shape=[2, 3])
    with pytest.raises(ValueError, match="unknown scikit-learn dataset 'mnist'"):
        load_dataset("sklearn:mnist")


def test_synthetic_deterministic_and_shaped() -> None:
    a = load_dataset("synthetic", seed=3, num_samples=500, num_classes=4)
    b = load_dataset("synthetic", seed=3, num_samples=500, num_classes=4)
    c = load_dataset("synthetic", seed=4, num_samples=500, num_classes=4)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.shape == (400, 64) and a.num_classes == 4
    assert np.bincount(a.y_train).min() >= 95  # balanced classes
    img = load_dataset("synthetic", feature_shape=(1, 8, 8), num_samples=100)
    assert img.x_train.shape == (80, 1, 8, 8) and img.num_features == 64
    reg = load_dataset("synthetic", task="regression", num_features=5, num_samples=300)
    assert reg.task == "regression" and reg.y_train.dtype == np.float32 and reg.x_train.shape == (240, 5)
    # The target is (nearly) linear in the features: least squares explains most variance.
    x1 = np.c_[reg.x_train, np.ones(len(reg.x_train))]
    coef, *_ = np.linalg.lstsq(x1, reg.y_train, rcond=None)
    resid = reg.y_train - x1 @ coef
    assert resid.var() < 0.05 * reg.y_train.var()


def test_synthetic_is_learnable() -> None:
    d = load_dataset("synthetic", seed=0, num_samples=2048)
    x, y = to_tensors(d.x_train, d.y_train)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = ShardIterator(len(x), 64, 0, 1, seed=0)
    for _ in range(300):
        idx = torch.from_numpy(it.next_indices())
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        train_acc = (model(x).argmax(1) == y).float().mean().item()
        xt, yt = to_tensors(d.x_test, d.y_test)
        test_acc = (model(xt).argmax(1) == yt).float().mean().item()
    assert train_acc > 0.9 and test_acc > 0.85


def _arrays(n: int = 60, regression: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) if regression else np.arange(n) % 3
    return x, y


def test_npz_roundtrip(tmp_path: Path) -> None:
    x, y = _arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    d = load_dataset("d.npz", base_dir=tmp_path, standardize=False, test_fraction=0.25)
    assert d.task == "classification" and d.num_classes == 3
    assert d.x_train.shape == (45, 3) and d.x_test.shape == (15, 3)
    got = np.concatenate([d.x_train, d.x_test])
    assert np.allclose(np.sort(got, axis=0), np.sort(x.astype(np.float32), axis=0))
    xr, yr = _arrays(regression=True)
    np.savez(tmp_path / "r.npz", x=xr, y=yr)
    r = load_dataset(str(tmp_path / "r.npz"))  # absolute path, base_dir ignored
    assert r.task == "regression" and r.y_train.dtype == np.float32
    np.savez(tmp_path / "bad.npz", features=x, y=y)
    with pytest.raises(ValueError, match=r"'x' and 'y'.*features"):
        load_dataset("bad.npz", base_dir=tmp_path)
    np.savez(tmp_path / "short.npz", x=x, y=y[:-1])
    with pytest.raises(ValueError, match="'y' must be 1-D"):
        load_dataset("short.npz", base_dir=tmp_path)


def _write_csv(path: Path, x: np.ndarray, y: np.ndarray, target: str = "label") -> None:
    lines = [",".join(["f0", "f1", target, "f2"])]
    lines += [f"{a},{b},{t},{c}" for (a, b, c), t in zip(x.tolist(), y.tolist(), strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_csv_and_parquet_roundtrip(tmp_path: Path) -> None:
    x, y = _arrays()
    _write_csv(tmp_path / "d.csv", x, y)
    d = load_dataset("d.csv", base_dir=tmp_path, standardize=False, test_fraction=0.5)
    assert d.task == "classification" and d.num_classes == 3 and d.num_features == 3
    rows = {tuple(np.round(r, 4)) for r in np.concatenate([d.x_train, d.x_test])}
    assert rows == {tuple(np.round(r, 4)) for r in x.astype(np.float32)}
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "target": _arrays(regression=True)[1]})
    pq.write_table(table, tmp_path / "d.parquet")
    p = load_dataset("d.parquet", base_dir=tmp_path, target="target", test_fraction=0.2)
    assert p.task == "regression" and p.x_train.shape == (48, 3)
    # String labels are mapped to class ids in sorted order.
    names = np.array(["cat", "dog", "emu"])[y]
    _write_csv(tmp_path / "s.csv", x, names, target="kind")
    s = load_dataset("s.csv", base_dir=tmp_path, target="kind")
    assert s.classes == ("cat", "dog", "emu") and s.num_classes == 3 and s.y_train.dtype == np.int64


def test_missing_file_and_column_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_dataset("data/nope.csv", base_dir=tmp_path)
    x, y = _arrays()
    _write_csv(tmp_path / "d.csv", x, y, target="klass")
    with pytest.raises(ValueError, match=r"'label' not found; columns: f0, f1, klass, f2"):
        load_dataset("d.csv", base_dir=tmp_path)
    with pytest.raises(ValueError, match="not 'synthetic'"):
        load_dataset("d.txt", base_dir=tmp_path)
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("synthetic", test_fraction=1.0)


def test_source_helpers(tmp_path: Path) -> None:
    assert data_source_kind("synthetic") == "synthetic"
    assert data_source_kind("sklearn:digits") == "sklearn"
    assert data_source_kind("x/y.npz") == "file"
    assert resolve_data_path("sklearn:digits", tmp_path) is None
    assert resolve_data_path("d.npz", tmp_path) == tmp_path / "d.npz"
    assert resolve_data_path("/abs/d.npz", tmp_path) == Path("/abs/d.npz")
    check_source("synthetic")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "d.npz")):
        check_source("d.npz", tmp_path)


def test_to_tensors() -> None:
    x, y = to_tensors(np.ones((2, 3), dtype=np.float64), np.array([1, 0], dtype=np.int32))
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    _, yr = to_tensors(np.ones((2, 3)), np.array([0.5, 1.5]))
    assert yr.dtype == torch.float32


def test_an_evaluation_file_beside_a_training_file(tmp_path: Path) -> None:
    """eval_source: the whole training file trains, the other file evaluates, labels mapped as one
    (the eval file lacks a class) and standardised with the training statistics only."""
    x, y = _arrays()
    names = np.array(["cat", "dog", "emu"])[y]
    _write_csv(tmp_path / "train.csv", x, names, target="kind")
    held_x = x[:10] * 3 + 5
    _write_csv(tmp_path / "eval.csv", held_x, np.array(["dog", "emu"])[np.arange(10) % 2], target="kind")
    d = load_dataset("train.csv", base_dir=tmp_path, target="kind", eval_source="eval.csv", test_fraction=0.5)
    assert len(d.x_train) == len(x) and len(d.x_test) == 10  # test_fraction does not apply
    assert d.classes == ("cat", "dog", "emu") and list(d.y_test[:2]) == [1, 2]
    expect = (held_x - x.mean(axis=0)) / x.std(axis=0)
    assert np.allclose(d.x_test, expect, atol=1e-4)
    (tmp_path / "narrow.csv").write_text("f0,kind\n1.0,cat\n2.0,dog\n")
    with pytest.raises(ValueError, match="needs the training file's features"):
        load_dataset("train.csv", base_dir=tmp_path, target="kind", eval_source="narrow.csv")


def test_no_held_out_share() -> None:
    d = load_dataset("sklearn:digits", test_fraction=0.0)
    assert len(d.x_train) == 1797 and len(d.x_test) == 0
