"""Tests for dtrain.model: layer building, shape inference, custom modules, losses, init."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dtrain.model.build import build_custom, import_object
from dtrain.model.layers import (
    LAYER_TYPES,
    LOSSES,
    LayerError,
    LayerShapeError,
    NotAModuleError,
    accuracy,
    build_layers,
    check_output,
    get_loss,
    infer_shapes,
    init_parameters,
    is_classification,
    output_shape,
    param_layout,
)
from tests.helpers.paths import ROOT

MLP = [{"type": "linear", "out": 128}, {"type": "relu"}, {"type": "linear", "out": 10}]
CNN = [
    {"type": "reshape", "shape": [1, 8, 8]},
    {"type": "conv2d", "out": 4, "kernel_size": 3, "padding": 1},
    {"type": "relu"},
    {"type": "max_pool2d", "kernel_size": 2},
    {"type": "conv2d", "out": 6, "kernel_size": 3},
    {"type": "avg_pool2d", "kernel_size": 2},
    {"type": "flatten"},
    {"type": "linear", "out": 10},
]


def test_build_mlp_names_and_shapes() -> None:
    model = build_layers([64], MLP)
    assert isinstance(model, nn.Sequential) and len(model) == 3
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert param_layout(model) == [
        ("0.weight", (128, 64), 8192),
        ("0.bias", (128,), 128),
        ("2.weight", (10, 128), 1280),
        ("2.bias", (10,), 10),
    ]
    assert model(torch.randn(5, 64)).shape == (5, 10)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_every_layer_type_builds() -> None:
    layers = [
        {"type": "linear", "out": 16, "bias": False},
        {"type": "batch_norm1d"},
        {"type": "layer_norm"},
        {"type": "gelu"},
        {"type": "tanh"},
        {"type": "sigmoid"},
        {"type": "leaky_relu", "negative_slope": 0.2},
        {"type": "elu"},
        {"type": "silu"},
        {"type": "identity"},
        {"type": "dropout", "p": 0.1},
        {"type": "reshape", "shape": [4, -1]},
        {"type": "flatten"},
        {"type": "linear", "out": 3, "in": 16, "name": "head", "device": "/job:worker"},
    ]
    # the tables take integer ids (tests/model/test_tables.py and the embedding test below)
    assert {layer["type"] for layer in layers} | {"relu", "conv2d", "max_pool2d", "avg_pool2d", "embedding",
                                                  "embedding_bag"} == set(LAYER_TYPES)
    model = build_layers([8], layers)
    assert infer_shapes([8], layers)[-3:] == [(4, 4), (16,), (3,)]
    assert model[0].bias is None
    assert model[6].negative_slope == 0.2
    assert model(torch.randn(4, 8)).shape == (4, 3)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias", "13.weight", "13.bias"]


def test_cnn_shapes() -> None:
    shapes = infer_shapes([64], CNN)
    assert shapes == [(1, 8, 8), (4, 8, 8), (4, 8, 8), (4, 4, 4), (6, 2, 2), (6, 1, 1), (6,), (10,)]
    model = build_layers([64], CNN)
    assert model(torch.randn(3, 64)).shape == (3, 10)
    strided = [
        {"type": "conv2d", "out": 2, "kernel_size": [3, 1], "stride": 2},
        {"type": "max_pool2d", "kernel_size": 2, "stride": 1},
    ]
    assert infer_shapes([3, 9, 9], strided) == [(2, 4, 5), (2, 3, 4)]


def test_infer_shapes_on_meta_does_not_allocate() -> None:
    """In a fresh process (its own peak, VmHWM: getrusage's maxrss would also count the pages of the
    forked test process it was exec'd from, as Linux does): inferring
    the shapes of, and building on meta, layers of 64 x 10**7 floats (2.5 GB if allocated, and
    written by their initialisation) leaves the process's peak far below that."""
    code = """
from dtrain.model.layers import build_layers, infer_shapes, param_layout
layers = [{"type": "linear", "out": 10**7}, {"type": "relu"}, {"type": "linear", "out": 64}]
assert infer_shapes([64], layers) == [(10**7,), (10**7,), (64,)]
meta = build_layers([64], layers[:1], device="meta")
assert meta[0].weight.is_meta
assert param_layout(meta) == [("0.weight", (10**7, 64), 64 * 10**7), ("0.bias", (10**7,), 10**7)]
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 1024  # MiB: torch alone is a few hundred


@pytest.mark.parametrize(
    ("input_shape", "layers", "index", "fragments"),
    [
        (
            [64],
            [{"type": "linear", "out": 32}, {"type": "relu"}, {"type": "linear", "out": 5, "in": 64}],
            2,
            ["layer 2 (linear) expects input of shape (..., 64)", "receives (32,)", "from layer 1 (relu)"],
        ),
        (
            [64],
            [
                {"type": "reshape", "shape": [1, 8, 8]},
                {"type": "conv2d", "out": 2, "kernel_size": 3},
                {"type": "linear", "out": 3},
            ],
            2,
            ["receives (2, 6, 6)", "from layer 1 (conv2d)", "add {type: flatten} before it"],
        ),
        (
            [64],
            [{"type": "conv2d", "out": 2, "kernel_size": 3}],
            0,
            ["(C, H, W)", "receives (64,)", "from the input", "reshape"],
        ),
        (
            [1, 8, 8],
            [{"type": "relu"}, {"type": "conv2d", "out": 2, "kernel_size": 9}],
            1,
            ["layer 1 (conv2d)", "(1, 8, 8)", "layer 0 (relu)"],
        ),
        ([1, 4, 4], [{"type": "max_pool2d", "kernel_size": 5}], 0, ["max_pool2d", "(1, 4, 4)"]),
        (
            [64],
            [{"type": "reshape", "shape": [3, 7], "name": "r"}],
            0,
            ["layer 0 'r' (reshape)", "21 elements", "(64,)"],
        ),
        ([3, 4, 4], [{"type": "batch_norm1d"}], 0, ["(C,) or (C, L)", "(3, 4, 4)", "flatten"]),
    ],
)
def test_infer_shapes_errors(input_shape, layers, index, fragments) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayerShapeError) as info:
        infer_shapes(input_shape, layers)
    assert isinstance(info.value, ValueError)
    assert info.value.index == index
    for fragment in fragments:
        assert fragment in str(info.value)
    with pytest.raises(LayerShapeError):
        build_layers(input_shape, layers)


def test_layer_config_errors() -> None:
    with pytest.raises(LayerError) as info:
        infer_shapes([4], [{"type": "relu"}, {"type": "convolution"}])
    assert info.value.index == 1 and "unknown layer type 'convolution'" in str(info.value)
    assert not isinstance(info.value, LayerShapeError)
    with pytest.raises(LayerError, match="missing required parameter 'out'") as info:
        infer_shapes([4], [{"type": "linear"}])
    assert info.value.index == 0
    with pytest.raises(LayerError, match="'kernel_size' must be"):
        infer_shapes([1, 4, 4], [{"type": "conv2d", "out": 1, "kernel_size": 0}])
    with pytest.raises(ValueError, match="input_shape"):
        infer_shapes([0], MLP)


def test_output_shape_and_check_output() -> None:
    model = build_layers([64], MLP)
    assert output_shape(model, [64]) == (10,)
    assert output_shape(build_layers([64], MLP, device="meta"), [64]) == (10,)
    check_output((10,), "cross_entropy", num_classes=10)
    check_output((1,), "mse")
    check_output((), "mse")  # a module returning (batch,): one value per sample, as (batch, 1)
    check_output((), "bce_with_logits")
    with pytest.raises(ValueError, match="at least 10 outputs"):
        check_output((3,), "cross_entropy", num_classes=10)
    with pytest.raises(ValueError, match="flatten"):
        check_output((2, 5), "cross_entropy")
    with pytest.raises(ValueError, match=r"out: 1"):
        check_output((10,), "mse")


def test_init_determinism() -> None:
    a = build_layers([64], CNN[:2] + [{"type": "flatten"}, {"type": "linear", "out": 3}], seed=7)
    torch.manual_seed(123)  # unrelated global RNG state must not matter
    b = build_layers([64], CNN[:2] + [{"type": "flatten"}, {"type": "linear", "out": 3}], seed=7)
    c = build_layers([64], CNN[:2] + [{"type": "flatten"}, {"type": "linear", "out": 3}], seed=8)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a[1].weight, c[1].weight)
    # init_parameters re-initialises in place, and leaves the global RNG as it was.
    state = torch.get_rng_state()
    with torch.no_grad():
        for p in c.parameters():
            p.zero_()
    init_parameters(c, 7)
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pc in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc)


def test_import_object() -> None:
    assert import_object("torch.nn:Linear") is nn.Linear
    assert import_object("torch.nn.Linear") is nn.Linear
    assert import_object("collections:OrderedDict.fromkeys") is not None
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        import_object("no_such_module_xyz:Net")
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        import_object("torch.nn:Nope")
    for bad in ["", "Linear", "torch.nn:", ":Linear", "torch.nn:1abc"]:
        with pytest.raises(ValueError):
            import_object(bad)


def test_build_custom(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "dtrain_test_custom_models.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, hidden=8):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, hidden)\n"
        "        self.scale = torch.nn.Parameter(torch.randn(hidden))\n"
        "    def forward(self, x):\n"
        "        return self.fc(x) * self.scale\n"
        "def make(hidden):\n"
        "    return Net(hidden)\n"
        "def not_a_module():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    net = build_custom("dtrain_test_custom_models:Net", {"hidden": 5})
    assert param_layout(net) == [("scale", (5,), 5), ("fc.weight", (5, 4), 20), ("fc.bias", (5,), 5)]
    assert isinstance(build_custom("dtrain_test_custom_models.make", {"hidden": 3}), nn.Module)
    a = build_custom("dtrain_test_custom_models:Net", {}, seed=3)
    b = build_custom("dtrain_test_custom_models:Net", {}, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    meta = build_custom("dtrain_test_custom_models:Net", {"hidden": 10**7}, device="meta")
    assert meta.fc.weight.is_meta and output_shape(meta, [4]) == (10**7,)
    with pytest.raises(NotAModuleError, match="returned int"):
        build_custom("dtrain_test_custom_models:not_a_module", {})
    with pytest.raises(TypeError, match="bogus"):
        build_custom("dtrain_test_custom_models:Net", {"bogus": 1})


def test_losses() -> None:
    assert set(LOSSES) == {"cross_entropy", "mse", "bce_with_logits"}
    assert is_classification("cross_entropy") and is_classification("bce_with_logits")
    assert not is_classification("mse")
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("hinge")
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    labels = torch.tensor([0, 1])
    expected = nn.functional.cross_entropy(logits, labels)
    assert torch.allclose(LOSSES["cross_entropy"](logits, labels), expected)
    assert accuracy(logits, labels, "cross_entropy") == 1.0
    out = torch.tensor([[1.0], [2.0], [4.0]])
    target = torch.tensor([1, 2, 3])  # int, 1-D: cast and squeezed, no broadcasting to 3x3
    assert LOSSES["mse"](out, target).item() == pytest.approx(1 / 3)
    bce = LOSSES["bce_with_logits"](torch.tensor([[0.0], [0.0]]), torch.tensor([0, 1]))
    assert bce.item() == pytest.approx(0.6931, abs=1e-4)
    assert accuracy(torch.tensor([[2.0], [-1.0]]), torch.tensor([1, 1]), "bce_with_logits") == 0.5
    loss = LOSSES["mse"](torch.randn(4, 1, requires_grad=True), torch.randn(4))
    loss.backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_build_on_cuda_matches_cpu() -> None:
    cpu = build_layers([64], MLP, seed=11)
    gpu = build_layers([64], MLP, device="cuda", seed=11)
    assert all(p.is_cuda for p in gpu.parameters())
    for a, b in zip(cpu.parameters(), gpu.parameters(), strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize(("layer", "shapes"), [
    ({"type": "embedding", "num_embeddings": 30, "dim": 4}, [(3, 4), (12,), (2,)]),
    ({"type": "embedding_bag", "num_embeddings": 30, "dim": 4, "mode": "sum"}, [(4,), (4,), (2,)]),
])
def test_embedding_layers_build_first_and_take_ids(layer, shapes) -> None:
    layers = [layer, {"type": "flatten"}, {"type": "linear", "out": 2}]
    assert infer_shapes([3], layers) == shapes
    model = build_layers([3], layers)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "2.weight", "2.bias"]
    assert model[0].weight.shape == (30, 4) and model[0].sparse
    out = model(torch.tensor([[1, 2, 29], [0, 0, 5]]))
    assert out.shape == (2, 2)
    out.sum().backward()
    assert model[0].weight.grad.is_sparse  # torch's sparse path, as nn.Embedding(sparse=True)
