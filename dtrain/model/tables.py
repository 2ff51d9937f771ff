"""Embedding tables: the ``embedding`` / ``embedding_bag`` layers, their seeded chunked
initialisation, and the *gathered* form a replica computes with.

A table (``Table``) exists in two forms:

- **full**: a ``weight`` parameter of (num_embeddings, dim), as ``nn.Embedding`` has. This is what
  ``dtrain.build_model(spec)`` builds (reference runs, ``model.pt``) and what the ps tasks hold,
  partitioned by rows.
- **gathered**: no parameter at all. Before each step the replica hands the module the sorted
  unique ids the batch touches and their rows (``gather``); forward maps the batch's ids into
  those rows, and backward leaves the rows' gradient in ``rows.grad``: exactly the sparse
  gradient (unique ids, summed row gradients) that is pushed to the ps.

Initialisation never depends on where rows live: rows are drawn in chunks of ``CHUNK_ROWS``, chunk
``c`` from its own generator seeded by (seed, table name, c), so a ps holding any subset of rows
draws the same values the full table has. Pure torch: no Dask, no spec.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_ROWS = 1 << 16
TABLE_TYPES = ("embedding", "embedding_bag")
INIT_SCHEMES = ("chunked", "uniform", "constant", "per_id")
"""How a table's rows start, with ``init_std`` as the scale: ``chunked`` normal(0, init_std) drawn in
seeded chunks (the ``embedding`` layers, and a module's embeddings by default); ``uniform``
uniform(-init_std, init_std) in the same chunks; ``constant`` every value init_std; ``per_id``
uniform with standard deviation init_std, drawn per id (``model.tables``: dtrain.model.ids)."""
_CHUNKED = {"chunked": "normal", "uniform": "uniform", "constant": "constant"}


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of table ``name`` (stable across processes)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode()) * 7919 + int(chunk) * 104_729) % (2**63 - 1)


def _chunk(seed: int, name: str, chunk: int, num_embeddings: int, dim: int, std: float,
           dist: str = "normal") -> torch.Tensor:
    start = chunk * CHUNK_ROWS
    n = min(CHUNK_ROWS, num_embeddings - start)
    out = torch.empty((n, dim), dtype=torch.float32)
    if dist == "constant":
        return out.fill_(std)
    g = torch.Generator().manual_seed(chunk_seed(seed, name, chunk))
    if dist == "uniform":
        return out.uniform_(-std, std, generator=g)
    out.normal_(0.0, std, generator=g)
    return out


def init_rows(seed: int, name: str, num_embeddings: int, dim: int, std: float, rows: torch.Tensor | range,
              out: torch.Tensor | None = None, init: str = "chunked") -> torch.Tensor:
    """The initial values of the table's ``rows`` (global ids: a ``range`` or an increasing int64
    tensor), into ``out`` when given, for the chunked schemes of :data:`INIT_SCHEMES` (``init``).
    Memory: ``out`` plus one chunk."""
    dist = _CHUNKED[init]
    if isinstance(rows, range):
        if rows.step < 1:
            raise ValueError("rows must be increasing")
        first, last, step = rows.start, rows.stop - 1, rows.step
        count = len(rows)
    else:
        rows = rows.to(torch.int64)
        count = rows.numel()
        first, last = (int(rows[0]), int(rows[-1])) if count else (0, -1)
    if out is None:
        out = torch.empty((count, dim), dtype=torch.float32)
    if count == 0:
        return out
    if first < 0 or last >= num_embeddings:
        raise ValueError(f"rows [{first}, {last}] outside the table of {num_embeddings} rows")
    done = 0
    for c in range(first // CHUNK_ROWS, last // CHUNK_ROWS + 1):
        lo, hi = c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, num_embeddings)
        if isinstance(rows, range):  # rows in [lo, hi): arithmetic, no index tensor
            k0 = max(0, -(-(lo - first) // step))
            k1 = min(count, -(-(hi - first) // step))
            if k1 <= k0:
                continue
            local = torch.arange(first + k0 * step, first + k1 * step, step) - lo
        else:
            k0 = int(torch.searchsorted(rows, lo))
            k1 = int(torch.searchsorted(rows, hi))
            if k1 <= k0:
                continue
            local = rows[k0:k1] - lo
        block = _chunk(seed, name, c, num_embeddings, dim, std, dist)
        torch.index_select(block, 0, local, out=out[done:done + (k1 - k0)])
        done += k1 - k0
    assert done == count
    return out


def div_starts(num_embeddings: int, num_parts: int) -> list[int]:
    """TensorFlow's div strategy: the first ``N % P`` parts hold ``N // P + 1`` rows, the rest ``N // P``."""
    base, extra = divmod(num_embeddings, num_parts)
    starts = [0]
    for p in range(num_parts):
        starts.append(starts[-1] + base + (1 if p < extra else 0))
    return starts


def global_rows(num_embeddings: int, num_parts: int, part: int, strategy: str) -> range:
    """The global ids part ``part`` holds, in local-row order."""
    if strategy == "mod":
        return range(part, num_embeddings, num_parts)
    starts = div_starts(num_embeddings, num_parts)
    return range(starts[part], starts[part + 1])


class Table(nn.Module):
    """An ``embedding`` (ids (B, F) -> (B, F, D)) or ``embedding_bag`` (-> (B, D), ``mode`` sum or
    mean) layer, full or gathered (module docstring). ``name`` is the table's parameter name
    (``"0.weight"``): it seeds the initialisation and names the table in plans and ``model.pt``.
    ``storage`` (float32, bfloat16, float16) and ``optimizer`` (a row optimizer config replacing
    the run's ``optimizer`` section for this table; None: the run's) say how the ps tasks keep its
    rows (docs/sparse.md); the module itself computes in float32 either way."""

    def __init__(self, num_embeddings: int, dim: int, kind: str = "embedding", mode: str = "mean",
                 sparse: bool = True, init_std: float = 1.0, name: str = "", seed: int = 0,
                 gathered: bool = False, device: torch.device | str | None = None, storage: str = "float32",
                 optimizer: dict | None = None, init: str = "chunked", dynamic: dict | None = None):
        super().__init__()
        if kind not in TABLE_TYPES:
            raise ValueError(f"unknown table kind {kind!r}; use {' or '.join(TABLE_TYPES)}")
        self.num_embeddings, self.dim, self.kind, self.mode = int(num_embeddings), int(dim), kind, mode
        self.sparse, self.init_std, self.name, self.seed = sparse, float(init_std), name, int(seed)
        self.gathered = gathered
        self.storage, self.optimizer = storage, (dict(optimizer) if optimizer is not None else None)
        if init not in INIT_SCHEMES:
            raise ValueError(f"table {name}: init {init!r} is not one of {', '.join(INIT_SCHEMES)}")
        # per_id: row i starts at dtrain.model.ids.id_rows(i), as a table without a vocabulary's rows do
        self.init = "per_id" if dynamic is not None else init
        # A table without a vocabulary (max_rows, min_count, ttl_steps, eviction): its full form holds
        # the rows of the ids it has (``row_ids``, sorted) and reads zeros for any other id.
        self.dynamic = dict(dynamic) if dynamic is not None else None
        self.recording: list[torch.Tensor] | None = None  # a record pass: the ids forward was given
        self.ids: torch.Tensor | None = None  # gathered: the sorted unique ids of this step
        self.rows: torch.Tensor | None = None  # gathered: their rows (a leaf that collects the gradient)
        self._init_seed: int | None = None  # the seed the weight was last initialised with
        if self.dynamic is not None:
            self.num_embeddings = 0
            self.register_buffer("row_ids", torch.empty(0, dtype=torch.int64, device=device))
        if not gathered:
            self.weight = nn.Parameter(torch.empty((self.num_embeddings, self.dim), device=device))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The seeded chunked initialisation (its own generators: the global RNG is not used, so
        the other layers' initial values do not depend on whether this table is full or gathered)."""
        weight = getattr(self, "weight", None)
        if weight is None or weight.device.type == "meta" or self._init_seed == self.seed:
            return  # (the values depend on the seed only: drawing them again would give the same)
        self._init_seed = self.seed
        with torch.no_grad():
            if self.init == "per_id":
                from .ids import id_rows

                for lo in range(0, self.num_embeddings, CHUNK_ROWS):
                    ids = torch.arange(lo, min(lo + CHUNK_ROWS, self.num_embeddings))
                    weight[lo:lo + len(ids)].copy_(id_rows(self.seed, self.name, ids, self.dim, self.init_std))
                return
            values = init_rows(self.seed, self.name, self.num_embeddings, self.dim, self.init_std,
                               range(self.num_embeddings), init=self.init)
            weight.copy_(values)

    def make_full(self, weight: torch.Tensor, row_ids: torch.Tensor | None = None) -> None:
        """Turn a gathered table into a full one holding ``weight`` (the chief's ``model.pt``); a
        table without a vocabulary: the rows of ``row_ids`` (sorted)."""
        self.gathered, self.ids, self.rows = False, None, None
        self.weight = nn.Parameter(weight, requires_grad=True)
        if self.dynamic is not None:
            self.row_ids = row_ids if row_ids is not None else torch.empty(0, dtype=torch.int64)
            self.num_embeddings = len(self.row_ids)
        self._init_seed = self.seed

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A table without a vocabulary holds as many rows as the state it loads (model.pt).
        ids = state_dict.get(prefix + "row_ids")
        if self.dynamic is not None and ids is not None and not self.gathered:
            self.make_full(torch.empty((len(ids), self.dim), device=self.weight.device), ids.clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def gather(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Gathered form: this step's sorted unique ``ids`` and their ``rows`` (made a leaf that
        requires grad: after backward ``self.rows.grad`` is the rows' summed gradient)."""
        # Plain attributes, set past nn.Module.__setattr__ (its checks for parameters, buffers and
        # modules cost more than the rest of a step's gathering, 2 x tens of tables a step).
        self.__dict__["ids"] = ids
        self.__dict__["rows"] = rows.detach().requires_grad_(True)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index into the weight or rows, weight or rows) for ids ``x``."""
        if not self.gathered and self.dynamic is not None:  # its ids' rows; zeros for any other id
            pos = torch.searchsorted(self.row_ids, x.contiguous())
            known = pos < len(self.row_ids)
            known[known.clone()] = self.row_ids[pos[known]] == x[known]
            zero = torch.zeros((1, self.dim), dtype=self.weight.dtype, device=self.weight.device)
            return torch.where(known, pos, len(self.row_ids)), torch.cat([self.weight, zero])
        if not self.gathered:
            return x, self.weight
        if self.ids is None or self.rows is None:
            raise RuntimeError(f"table {self.name}: no rows gathered for this step")
        pos = torch.searchsorted(self.ids, x.contiguous())
        if pos.numel() and (int(pos.max()) >= len(self.ids) or not bool((self.ids[pos] == x).all())):
            raise RuntimeError(f"table {self.name}: the batch has ids that were not gathered")
        return pos, self.rows

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``embedding``: ids (B, F) -> (B, F, D). ``embedding_bag``: ids (B, F) -> (B, D), or, with
        ``offsets`` (B,), flat ids pooled per example (``nn.EmbeddingBag``'s convention, optionally
        weighted by ``per_sample_weights``, which needs mode sum)."""
        if offsets is not None and self.kind != "embedding_bag":
            raise ValueError(f"table {self.name}: offsets apply to an embedding_bag table")
        if x.device.type == "meta":  # shape inference
            return torch.empty(self._out_shape(x, offsets), device="meta")
        if x.dtype.is_floating_point:
            raise TypeError(f"table {self.name or self.kind} takes integer ids, got {x.dtype} features")
        if self.recording is not None:  # which ids this batch needs, before any row is here
            self.recording.append(x.detach().reshape(-1).to(torch.int64))
            return torch.zeros(self._out_shape(x, offsets), device=x.device)
        index, weight = self.lookup(x.long())
        sparse = self.sparse and not self.gathered and self.dynamic is None  # (a dynamic full table: a view)
        if self.kind == "embedding":
            return F.embedding(index, weight, sparse=sparse)
        return F.embedding_bag(index, weight, offsets, mode=self.mode, sparse=sparse,
                               per_sample_weights=per_sample_weights)

    def _out_shape(self, x: torch.Tensor, offsets: torch.Tensor | None) -> tuple[int, ...]:
        if self.kind == "embedding":
            return (*x.shape, self.dim)
        return (len(offsets) if offsets is not None else x.shape[0], self.dim)

    def extra_repr(self) -> str:
        return (f"{self.kind} {self.num_embeddings}x{self.dim}" + (f", mode={self.mode}" if self.kind != "embedding"
                else "") + (", gathered" if self.gathered else "") + (", sparse" if self.sparse else ""))


def tables_of(module: nn.Module) -> list[tuple[str, Table]]:
    """(weight name, module) of every sparse Table in ``module``, in ``named_modules`` order."""
    out = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, Table) and sub.sparse:
            out.append((f"{prefix}.weight" if prefix else "weight", sub))
    return out


def table_info(table: Table) -> dict[str, Any]:
    return {"num_embeddings": table.num_embeddings, "dim": table.dim, "kind": table.kind, "mode": table.mode,
            "init_std": table.init_std, "storage": table.storage, "optimizer": table.optimizer}


def swap_embeddings(module: nn.Module, seed: int = 0, gathered: bool = False) -> list[str]:
    """Replace every ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True`` in a custom
    module by a :class:`Table` of the same size (named by its weight, initialised like the
    ``embedding`` layer: normal(0, 1), seeded and chunked), so a ``model.module`` model gets the
    sparse tables' path; an embedding that declares ``dtrain_init`` (:func:`declared_init`) starts
    as declared. Returns the tables' weight names; ValueError naming the layer for an
    option the tables do not have (``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, mode
    ``max``). Embeddings with ``sparse=False`` stay ordinary dense parameters."""
    found: list[tuple[str, nn.Embedding | nn.EmbeddingBag]] = [(n, m) for n, m in module.named_modules()
                                          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    names = []
    for name, emb in found:
        bag = isinstance(emb, nn.EmbeddingBag)
        why = ("padding_idx" if emb.padding_idx is not None else "max_norm" if emb.max_norm is not None
               else "scale_grad_by_freq" if emb.scale_grad_by_freq
               else "mode 'max'" if bag and emb.mode == "max"
               else "include_last_offset" if bag and emb.include_last_offset else None)
        if why:
            raise ValueError(f"{name}: a sparse {type(emb).__name__} with {why} is not supported as a ps table "
                             "(docs/sparse.md#limits): drop the option, or build it with sparse=False")
        init, scale = declared_init(name, emb)
        table = Table(emb.num_embeddings, emb.embedding_dim, kind="embedding_bag" if bag else "embedding",
                      mode=emb.mode if isinstance(emb, nn.EmbeddingBag) else "mean", init_std=scale, name=f"{name}.weight" if name else "weight",
                      seed=seed, gathered=gathered, device=emb.weight.device, init=init)
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        setattr(parent, name.rpartition(".")[2], table)
        names.append(table.name)
    return names


INIT_DECLARATIONS = {"normal": "chunked", "uniform": "uniform", "constant": "constant"}


def declared_init(name: str, emb: nn.Module) -> tuple[str, float]:
    """(init scheme, scale) of a module's sparse embedding: its ``dtrain_init`` attribute, one of
    ``{"normal": std}``, ``{"uniform": bound}``, ``{"constant": value}`` (a ps table's rows start on
    the ps, which cannot run the module's own initialisation code), or normal(0, 1), nn.Embedding's
    default. ValueError naming the layer for a malformed declaration."""
    declared = getattr(emb, "dtrain_init", None)
    if declared is None:
        return "chunked", 1.0
    ok = isinstance(declared, dict) and len(declared) == 1 and next(iter(declared)) in INIT_DECLARATIONS
    if ok:
        (kind, value), = declared.items()
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            kind == "constant" or value > 0)
    if not ok:
        raise ValueError(f"{name}.dtrain_init {declared!r}: declare one of {{'normal': std}}, {{'uniform': bound}} "
                         "(std, bound > 0) or {'constant': value}")
    return INIT_DECLARATIONS[kind], float(value)


def undeclared_init(module: nn.Module) -> list[str]:
    """The module's sparse embeddings (built by its own code, on a real device) whose values are not
    nn.Embedding's default normal(0, 1) and that declare no ``dtrain_init``: as ps tables they would
    silently start from normal(0, 1) instead. One message each, naming the layer and the fix."""
    out = []
    for name, emb in module.named_modules():
        if not (isinstance(emb, (nn.Embedding, nn.EmbeddingBag)) and emb.sparse) or hasattr(emb, "dtrain_init"):
            continue
        w = emb.weight.detach()
        if w.device.type == "meta" or not w.numel():
            continue
        n = w.numel()
        std, mean = float(w.float().std()) if n > 1 else 0.0, float(w.float().mean())
        # four standard errors of a normal(0, 1) sample's std and mean: a default table passes
        if abs(std - 1.0) > 4 * math.sqrt(1 / (2 * n)) + 1e-6 or abs(mean) > 4 / math.sqrt(n):
            what = f"all {mean:.4g}" if std == 0 else f"std {std:.3g}, mean {mean:.3g}"
            out.append(f"{name}: the module initialises this sparse embedding itself ({what}), but a ps table's "
                       f"rows start on the ps tasks, which do not run the module's code: declare it, e.g. "
                       f"self.{name.rpartition('.')[2]}.dtrain_init = "
                       f"{{'{'constant' if std == 0 else 'normal'}': {mean if std == 0 else float(f'{std:.2g}')}}} "
                       "({'normal': std}, {'uniform': bound} or {'constant': value})")
    return out
