"""A recommendation model's input and tables: ``model.features`` (dense columns; categorical
columns, each single-id or a bounded list of ids, optionally weighted, each looking up a named
table), ``model.tables`` (per table: rows, width, pooling, initialisation, row storage and its
own optimizer) and ``model.dlrm`` (bottom MLP, interaction, top MLP). docs/recommendation.md."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import NAME, Strict
from .errors import CrossFieldErrors

MAX_IDS_PER_FEATURE = 1024
"""The largest ``max_ids`` a categorical feature may declare (each example's ids are packed into
that many slots: docs/recommendation.md)."""

MAX_TABLE_ROWS = 2**40


class CategoricalFeature(Strict):
    """A categorical column: per example a list of ids pooled through a table."""

    name: str = Field(pattern=NAME, description="The column holding the ids (Criteo layout: C1 .. C26).")
    table: str | None = Field(None, pattern=NAME, description="The table (a key of model.tables) this feature "
                              "looks up; default: the table named like the feature. Several features may share one.")
    max_ids: int = Field(1, ge=1, le=MAX_IDS_PER_FEATURE, description="The most ids one example may hold in this "
                         "column (1: single-id; more: multi-hot). An example with more fails naming file, line and "
                         "column.")
    weighted: bool = Field(False, description="Each id carries a float weight (per_sample_weights of "
                           "nn.EmbeddingBag), read from the column '<name>_weights' of a parquet file.")

    @property
    def table_name(self) -> str:
        return self.table or self.name


class FeaturesSpec(Strict):
    """Which columns a recommendation model reads."""

    dense: list[Annotated[str, Field(pattern=NAME)]] = Field(
        default_factory=list, description="Dense (numeric) columns, in order, e.g. [I1, ..., I13]. Criteo-layout "
        "files transform them as log(1 + max(x, 0)), missing as 0.")
    categorical: list[CategoricalFeature] = Field(min_length=1, description="Categorical columns, each a list of "
                                                  "ids looked up in a table and pooled.")

    @model_validator(mode="after")
    def _unique(self) -> FeaturesSpec:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        seen: dict[str, str] = {}
        for i, name in enumerate(self.dense):
            if name in seen:
                problems.append((("dense", i), f"column {name!r} is listed twice ({seen[name]} already)"))
            seen[name] = f"dense[{self.dense.index(name)}]"
        for i, f in enumerate(self.categorical):
            if f.name in seen:
                problems.append((("categorical", i, "name"), f"column {f.name!r} is listed twice ({seen[f.name]} "
                                 "already): each column is one feature"))
            seen.setdefault(f.name, f"categorical[{i}]")
        if problems:
            raise CrossFieldErrors(problems)
        return self


class _TableOpt(Strict):
    """A table optimizer's common settings."""

    lr: float = Field(gt=0.0, description="Learning rate of this table's rows.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 on the rows a step touches (g += weight_decay * w, "
                                "as FBGEMM's weight_decay_mode L2); untouched rows do not decay.")


class TableSgd(_TableOpt):
    """SGD on the touched rows."""

    name: Literal["sgd"] = Field(description="w[rows] -= lr * g.")


class TableAdagrad(_TableOpt):
    """Adagrad on the touched rows, one accumulator per element."""

    name: Literal["adagrad"] = Field(description="Adagrad with one accumulator per element (torch.optim.Adagrad "
                                     "on a sparse gradient).")
    eps: float = Field(1e-10, gt=0.0, description="Term added to the denominator.")


class TableRowwiseAdagrad(_TableOpt):
    """Row-wise Adagrad on the touched rows, one accumulator per row."""

    name: Literal["rowwise_adagrad"] = Field(description="Row-wise Adagrad: one accumulator per row, the mean of "
                                             "the row gradient's squares (FBGEMM's EXACT_ROWWISE_ADAGRAD).")
    eps: float = Field(1e-8, gt=0.0, description="Term added to the denominator.")


class TableAdam(Strict):
    """Lazy Adam on the touched rows."""

    name: Literal["adam"] = Field(description="Lazy Adam: only the touched rows' moments change "
                                  "(torch.optim.SparseAdam).")
    lr: float = Field(gt=0.0, description="Learning rate of this table's rows.")
    eps: float = Field(1e-8, gt=0.0, description="Term added to the denominator.")


TableOptimizerSpec = Annotated[TableSgd | TableAdagrad | TableRowwiseAdagrad | TableAdam,
                               Field(discriminator="name")]


class TableSpec(Strict):
    """One embedding table, held on the ps tasks and partitioned by rows: a fixed number of rows, or
    none (a table without a vocabulary: any 64-bit id, rows created as ids are admitted)."""

    num_embeddings: int | None = Field(None, ge=1, le=MAX_TABLE_ROWS, description="Rows of the table; ids are "
                                       "folded into them by `fold`. Leave it out for a table without a vocabulary "
                                       "(then max_rows is required).")
    dim: int = Field(ge=1, le=4096, description="Width of each row.")
    pooling: Literal["sum", "mean"] = Field("sum", description="How an example's rows are pooled (weighted by the "
                                            "feature's weights when it has them).")
    fold: Literal["modulo", "none"] = Field("modulo", description="How a 64-bit id picks its row: modulo "
                                            "(id % num_embeddings, as the MLPerf DLRM reference caps its tables), "
                                            "or none (an id outside 0 .. num_embeddings - 1 fails the step).")
    init_std: float = Field(0.01, gt=0.0, description="Rows start uniform with this standard deviation (over "
                            "+-sqrt(3) init_std), each row drawn from the seed, the table's name and its id: the "
                            "same whatever the number of ps tasks, and the same fixed or without a vocabulary.")
    storage: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Row storage on the ps tasks; bfloat16 and float16 halve the memory and are updated "
        "with stochastic rounding. Replicas compute in float32.")
    optimizer: TableOptimizerSpec | None = Field(None, description="This table's optimizer (default: the "
                                                 "pipeline's optimizer section).")
    max_rows: int | None = Field(None, ge=1, le=MAX_TABLE_ROWS, description="Without num_embeddings: the most "
                                 "rows the table holds (split evenly over the ps tasks); past it the least recently "
                                 "(or frequently) used rows are evicted. Bounds the table's memory.")
    min_count: int = Field(1, ge=1, le=1_000_000, description="Without num_embeddings: how many requests must name "
                           "an id before it gets a trainable row; until then it reads zeros and its gradient is "
                           "dropped.")
    ttl_steps: int | None = Field(None, ge=1, le=2**40, description="Without num_embeddings: rows untouched for "
                                  "this many steps are evicted.")
    eviction: Literal["lru", "lfu"] = Field("lru", description="Without num_embeddings: which rows go when "
                                            "max_rows is reached: least recently (lru) or least frequently (lfu) "
                                            "used.")

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None

    @model_validator(mode="after")
    def _fixed_or_dynamic(self) -> TableSpec:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.dynamic:
            if self.max_rows is None:
                problems.append((("max_rows",), "a table without num_embeddings needs max_rows, the most rows it "
                                                "may hold (it bounds the ps's memory), e.g. max_rows: 1000000"))
            # (a default value is harmless, so that a dumped spec validates again)
            if self.fold != type(self).model_fields["fold"].default:
                problems.append((("fold",), "fold maps ids into a fixed number of rows; a table without "
                                            "num_embeddings keeps every id: remove fold"))
        else:
            for key in ("max_rows", "min_count", "ttl_steps", "eviction"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    problems.append(((key,), f"{key} applies to a table without num_embeddings (a fixed table "
                                             f"holds every row): remove {key}, or num_embeddings"))
        if problems:
            raise CrossFieldErrors(problems)
        return self


class DlrmSpec(Strict):
    """DLRM: a bottom MLP over the dense features, the pooled embeddings crossed with it, a top MLP."""

    bottom: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, description="Widths of the bottom MLP's layers "
                                                      "over the dense features (ReLU after each); with interaction "
                                                      "dot the last equals the tables' dim.")
    interaction: Literal["dot", "cat"] = Field("dot", description="dot: the pairwise dot products of the bottom "
                                               "output and the pooled embeddings (each pair once), concatenated "
                                               "with the bottom output; cat: all of them concatenated.")
    top: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, description="Widths of the top MLP's layers (ReLU "
                                                   "between them, none after the last): the last is the number of "
                                                   "outputs, 1 for a click-through logit.")
