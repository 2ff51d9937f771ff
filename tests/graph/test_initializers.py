"""Graph variables' initializers (pure torch): shapes, seeds and distributions (TF1's defaults)."""

from __future__ import annotations

import pytest
import torch

from dtrain.graph.initializers import INITIALIZERS, initialize

SHAPE = [200, 50]  # 10000 draws: the statistics below hold with a wide margin


def init(kind: str, seed: int = 1, shape=SHAPE, **kw) -> torch.Tensor:
    params = {"mean": 0.0, "stddev": 1.0, "minval": 0.0, "maxval": 1.0, **kw}
    return initialize({"type": kind, "seed": seed, **params}, shape)


@pytest.mark.parametrize("kind", INITIALIZERS)
def test_shape_dtype_and_determinism(kind):
    a, b = init(kind, seed=5), init(kind, seed=5)
    assert a.shape == (200, 50) and a.dtype == torch.float32
    assert torch.equal(a, b)  # the same seed, the same values
    assert init(kind, shape=[]).shape == ()  # a scalar
    if kind not in ("zeros", "ones"):
        assert not torch.equal(a, init(kind, seed=6))  # another seed, other values


def test_constant_initializers():
    assert torch.equal(init("zeros", shape=[2, 2]), torch.zeros(2, 2))
    assert torch.equal(init("ones", shape=[3]), torch.ones(3))


def test_random_normal_statistics():
    x = init("random_normal", mean=3.0, stddev=0.5)
    assert abs(x.mean().item() - 3.0) < 0.03 and abs(x.std().item() - 0.5) < 0.02
    assert (x - 3.0).abs().max() > 1.0  # untruncated: beyond 2 stddev too


def test_truncated_normal_is_within_two_stddev():
    x = init("truncated_normal", mean=-1.0, stddev=2.0)
    assert (x + 1.0).abs().max() <= 4.0
    assert abs(x.mean().item() + 1.0) < 0.06
    assert abs(x.std().item() - 2.0 * 0.8796) < 0.05  # the std of a normal cut at 2 sigma: 0.8796 sigma


def test_random_uniform_bounds_and_statistics():
    x = init("random_uniform", minval=-2.0, maxval=6.0)
    assert x.min() >= -2.0 and x.max() < 6.0
    assert abs(x.mean().item() - 2.0) < 0.1
    assert x.min() < -1.9 and x.max() > 5.9  # fills the range


def test_draws_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    init("random_normal")
    assert torch.equal(state, torch.random.get_rng_state())


def test_unknown_initializer():
    with pytest.raises(ValueError, match="unknown initializer 'glorot'"):
        init("glorot")
