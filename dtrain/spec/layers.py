"""The ``model`` section: layers (a discriminated union on ``type``) or a custom module by
import path, the input shape and the loss."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Strict, check_device_string
from .errors import CrossFieldErrors
from .features import DlrmSpec, FeaturesSpec, TableSpec

TABLE_LAYERS = ("embedding", "embedding_bag")  # sparse embedding tables: the first layer, integer ids

# ----------------------------------------------------------------------------------------- model


class _Layer(Strict):
    name: str | None = Field(None, description="Optional label shown by `dtrain plan`.")
    device: str | None = Field(
        None, description="Device of this layer's compute, e.g. /job:worker/task:1 or /gpu:0 (merged with the replica's)."
    )

    _device = field_validator("device")(classmethod(lambda cls, v: check_device_string(v)))

    def params(self) -> dict[str, Any]:
        return self.model_dump(exclude={"name", "device"})


class LinearLayer(_Layer):
    type: Literal["linear"] = Field(description="Fully connected layer on the last dimension.")
    out: int = Field(ge=1, description="Output features.")
    bias: bool = Field(True, description="Learn an additive bias.")


class ActivationLayer(_Layer):
    type: Literal["relu", "tanh", "gelu", "sigmoid", "silu", "elu", "identity"] = Field(
        description="Elementwise activation."
    )


class LeakyReluLayer(_Layer):
    type: Literal["leaky_relu"] = Field(description="Leaky ReLU.")
    negative_slope: float = Field(0.01, description="Slope for negative inputs.")


class DropoutLayer(_Layer):
    type: Literal["dropout"] = Field(description="Dropout (active in training only).")
    p: float = Field(0.5, ge=0.0, lt=1.0, description="Probability of zeroing an element.")


class FlattenLayer(_Layer):
    type: Literal["flatten"] = Field(description="Flatten every non-batch dimension.")


class ReshapeLayer(_Layer):
    type: Literal["reshape"] = Field(description="Reshape the non-batch dimensions.")
    shape: list[int] = Field(min_length=1, description="New non-batch shape, e.g. [1, 8, 8].")


class Conv2dLayer(_Layer):
    type: Literal["conv2d"] = Field(description="2-D convolution over (C, H, W) inputs.")
    out: int = Field(ge=1, description="Output channels.")
    kernel_size: int = Field(ge=1, description="Square kernel size.")
    stride: int = Field(1, ge=1, description="Stride.")
    padding: int = Field(0, ge=0, description="Zero padding on each side.")
    bias: bool = Field(True, description="Learn an additive bias.")


class Pool2dLayer(_Layer):
    type: Literal["max_pool2d", "avg_pool2d"] = Field(description="2-D pooling over (C, H, W) inputs.")
    kernel_size: int = Field(ge=1, description="Square window size.")
    stride: int | None = Field(None, ge=1, description="Stride (default: kernel_size).")


class NormLayer(_Layer):
    type: Literal["batch_norm1d", "layer_norm"] = Field(description="Normalisation over features.")


class EmbeddingLayer(_Layer):
    type: Literal["embedding"] = Field(
        description="Embedding table: integer ids (batch, fields) -> (batch, fields, dim); must be the first layer.")
    num_embeddings: int = Field(ge=1, description="Rows of the table (ids are 0 .. num_embeddings - 1).")
    dim: int = Field(ge=1, description="Width of each row.")
    sparse: bool = Field(True, description="Keep the table on the ps tasks, partitioned by rows, and move only the "
                                           "rows a batch touches (false: an ordinary dense parameter).")
    init_std: float = Field(1.0, gt=0, description="Standard deviation of the rows' normal initialisation.")


class EmbeddingBagLayer(EmbeddingLayer):
    type: Literal["embedding_bag"] = Field(  # type: ignore[assignment]
        description="Embedding table pooled over the fields: ids (batch, fields) -> (batch, dim); first layer only.")
    mode: Literal["sum", "mean"] = Field("mean", description="How the fields' rows are pooled.")


Layer = Annotated[
    LinearLayer | ActivationLayer | LeakyReluLayer | DropoutLayer | FlattenLayer | ReshapeLayer
    | Conv2dLayer | Pool2dLayer | NormLayer | EmbeddingLayer | EmbeddingBagLayer,
    Field(discriminator="type"),
]

LAYER_NAMES = (
    "linear", "relu", "tanh", "gelu", "sigmoid", "silu", "elu", "identity", "leaky_relu", "dropout", "flatten",
    "reshape", "conv2d", "max_pool2d", "avg_pool2d", "batch_norm1d", "layer_norm", "embedding", "embedding_bag",
)


MAX_DIM = 2**31 - 1  # one example's extent along one axis (torch indexes with int64: past it, a C++ error)


class ModelSpec(Strict):
    """The model: a stack of layers, a torch.nn.Module factory by import path, or a DLRM over
    declared features and tables."""

    input_shape: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] | None = Field(
        None, description="Shape of one example without the batch dimension, e.g. [64] or [1, 28, 28]."
    )
    layers: list[Layer] | None = Field(None, description="Layers applied in order (docs/pipeline-file.md describes each type).")
    module: str | None = Field(
        None, description="Import path of an nn.Module class or factory, 'package.module:Name' (instead of layers)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for `module`.")
    features: FeaturesSpec | None = Field(None, description="A recommendation model's input: dense columns and "
                                          "categorical (id list) columns, each looking up a table of model.tables.")
    tables: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], TableSpec] | None = Field(
        None, description="Embedding tables by name, each on the ps tasks (with model.features).")
    dlrm: DlrmSpec | None = Field(None, description="A DLRM over model.features and model.tables (instead of "
                                  "layers or module).")
    loss: Literal["cross_entropy", "mse", "bce_with_logits"] = Field(
        "cross_entropy", description="Training loss; cross_entropy makes it a classification task."
    )

    @field_validator("module")
    @classmethod
    def _module_path(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", v):
            raise ValueError(f"{v!r} is not an import path; write 'package.module:Name' (a module importable on "
                             "every worker, and an nn.Module class or factory in it)")
        return v

    @model_validator(mode="after")
    def _layers_or_module(self) -> ModelSpec:
        if self.dlrm is not None or self.features is not None or self.tables is not None:
            _check_recommendation(self)
            return self
        if self.layers is not None and self.module is not None:
            raise CrossFieldErrors([(("module",), "give either 'layers' (with 'input_shape') or 'module', not both; "
                                                  "remove one of them")])
        if self.layers is None and self.module is None:
            raise CrossFieldErrors([((), "the model needs 'layers' (with 'input_shape'), e.g. input_shape: [64] and "
                                         "layers: [{type: linear, out: 10}], or 'module: package.module:Name'")])
        if self.layers is not None and self.input_shape is None:
            raise CrossFieldErrors([(("input_shape",), "'layers' needs 'input_shape', the shape of one example "
                                                       "without the batch dimension, e.g. input_shape: [64]")])
        if self.layers is not None and not self.layers:
            raise CrossFieldErrors([(("layers",), "'layers' is empty; list at least one layer, "
                                                  "e.g. - {type: linear, out: 10}")])
        if self.layers:
            for i, layer in enumerate(self.layers[1:], start=1):
                if layer.type in TABLE_LAYERS:
                    raise CrossFieldErrors([(("layers", i, "type"), f"an {layer.type} layer takes the integer ids of "
                                             "the input, so it must be the first layer; move it to layers[0]")])
            if self.layers[0].type in TABLE_LAYERS and self.input_shape is not None \
                    and len(self.input_shape) != 1:
                raise CrossFieldErrors([(("input_shape",), f"an {self.layers[0].type} model takes ids of shape "
                                         f"(batch, fields): input_shape must be [fields], got {self.input_shape}")])
        if self.input_shape is not None and not self.input_shape:
            raise CrossFieldErrors([(("input_shape",), "'input_shape' is empty; give the shape of one example, "
                                                       "e.g. [64] or [1, 28, 28]")])
        return self


def _check_recommendation(model: ModelSpec) -> None:
    """``model.dlrm`` with ``model.features`` and ``model.tables``, or ``model.module`` with
    ``model.features`` (the module's own sparse embeddings are its tables): one problem per key."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    if model.module is not None and model.features is not None:
        for key in ("layers", "input_shape", "tables", "dlrm"):
            if getattr(model, key) is not None:
                problems.append(((key,), f"a model.module with features takes its tables from its own sparse "
                                         f"embeddings: remove '{key}'"))
        if problems:
            raise CrossFieldErrors(problems)
        return
    for key in ("layers", "module", "input_shape"):
        if getattr(model, key) is not None:
            problems.append(((key,), f"a model with dlrm, features and tables is built from them: remove '{key}'"))
    for key in ("dlrm", "features", "tables"):
        if getattr(model, key) is None:
            problems.append(((key,), f"a recommendation model needs 'dlrm', 'features' and 'tables': add '{key}' "
                                     "(docs/recommendation.md)"))
    if problems:
        raise CrossFieldErrors(problems)
    assert model.features is not None and model.tables is not None and model.dlrm is not None
    used = set()
    for i, f in enumerate(model.features.categorical):
        used.add(f.table_name)
        if f.table_name not in model.tables:
            problems.append((("features", "categorical", i, "table" if f.table else "name"),
                             f"feature {f.name!r} looks up table {f.table_name!r}, which model.tables does not have "
                             f"(tables: {', '.join(model.tables) or 'none'}): add it, or set table: to one of them"))
    for name in model.tables:
        if name not in used:
            problems.append((("tables", name), f"no feature looks up table {name!r}: remove it, or name it in a "
                                               "feature's table:"))
    if not model.features.dense:
        problems.append((("features", "dense"), "a DLRM's bottom MLP reads the dense columns: list at least one "
                                                "(e.g. dense: [I1, I2])"))
    for i, f in enumerate(model.features.categorical):
        table = model.tables.get(f.table_name)
        if f.weighted and table is not None and table.pooling != "sum":
            problems.append((("features", "categorical", i, "weighted"), f"weights pool by sum "
                             f"(nn.EmbeddingBag's per_sample_weights): table {f.table_name!r} pools by "
                             f"{table.pooling}; set its pooling: sum, or weighted: false"))
    width = model.dlrm.bottom[-1]
    if model.dlrm.interaction == "dot":
        for name, t in model.tables.items():
            if t.dim != width:
                problems.append((("tables", name, "dim"), f"interaction dot crosses the bottom MLP's output "
                                 f"({width} wide) with every pooled row: dim must be {width}, got {t.dim} (or use "
                                 "interaction: cat)"))
    outputs = model.dlrm.top[-1]
    if model.loss == "bce_with_logits" and outputs != 1:
        problems.append((("dlrm", "top"), f"bce_with_logits takes one logit per example: end top with 1, got "
                                          f"{outputs}"))
    if model.loss == "cross_entropy" and outputs < 2:
        problems.append((("dlrm", "top"), f"cross_entropy needs one logit per class (2 or more): top ends with "
                                          f"{outputs}; for clicks use loss: bce_with_logits"))
    if problems:
        raise CrossFieldErrors(problems)
