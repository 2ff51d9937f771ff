"""dtrain.data.ctr and the click-through pipeline it feeds (pipelines/ctr_sparse.yaml): the
committed data is what the generator writes, and the sparse-table pipeline, run in full on the
in-process cluster, learns: its accuracy is single-process torch's (sparse embeddings, the same
samples and steps) within 0.01, far above the majority class."""

from __future__ import annotations

import numpy as np
import pytest

import dtrain
from dtrain.data.ctr import main, make_ctr
from dtrain.worker.replica import dataset_for
from tests.helpers.paths import ROOT
from tests.helpers.reference import binary_accuracy as accuracy
from tests.helpers.reference import single_process

PIPELINE = ROOT / "pipelines" / "ctr_sparse.yaml"
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def test_the_committed_data_is_the_generators(tmp_path, capsys):
    main(["--out", str(tmp_path / "ctr.npz"), "--rows", "20000", "--fields", "8", "--vocab", "100000", "--seed", "0"])
    assert "20000 rows, 8 fields, ids < 100000" in capsys.readouterr().out
    fresh, committed = np.load(tmp_path / "ctr.npz"), np.load(ROOT / "pipelines" / "data" / "ctr_sparse.npz")
    assert fresh["x"].dtype == np.int32 and np.array_equal(fresh["x"], committed["x"])
    assert np.array_equal(fresh["y"], committed["y"])


def test_generator_is_seeded_zipfian_and_learnable():
    x, y = make_ctr(5000, 4, 1000, seed=1)
    assert x.shape == (5000, 4) and x.min() >= 0 and x.max() < 1000
    assert np.array_equal(x, make_ctr(5000, 4, 1000, seed=1)[0]) and not np.array_equal(x, make_ctr(5000, 4, 1000, 2)[0])
    counts = np.bincount(x[:, 0], minlength=1000)
    assert counts.max() > 20 * np.median(counts[counts > 0])  # a few hot ids, a long tail
    assert 0.3 < y.mean() < 0.7
    with pytest.raises(ValueError, match="vocab >= 2"):
        make_ctr(10, 2, 1)


def test_ctr_pipeline_learns_as_single_process_torch(inproc_client, tmp_path):
    spec = dtrain.load(PIPELINE, overrides=["summary.tensorboard=false"])
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == spec.training.steps
    final = result.summary["eval"]["accuracy"]
    reference = accuracy(single_process(spec, num_replicas=2), spec)
    assert abs(final - reference) <= 0.01, (final, reference)
    majority = max(dataset_for(spec).y_test.mean(), 1 - dataset_for(spec).y_test.mean())
    assert final >= majority + 0.15, (final, majority)
    assert abs(accuracy(result.model, spec) - final) < 1e-6  # the summary's figure is the returned model's
