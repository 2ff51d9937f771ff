"""Recommendation models over packed records: ``model.features`` + ``model.tables`` +
``model.dlrm`` (docs/recommendation.md).

A batch is one int64 matrix of records packed by :class:`dtrain.data.features.RecordLayout`
(dense values, then each categorical column's id slots, then its weights); the model unpacks it
into the dense tensor and, per feature, torch's ``nn.EmbeddingBag`` convention (ids, offsets,
per-sample weights). Each feature looks up a named table, a sparse :class:`~dtrain.model.tables.Table`
that lives on the ps tasks (the replica holds it *gathered*: only this batch's rows). The ids a
table needs are read straight from the records (:meth:`FeatureTables.table_ids`), so a step costs
no record pass.

Pure torch: no Dask, no spec objects (the builders take the spec's dumped sections).
"""

from __future__ import annotations

from collections.abc import ItemsView, Mapping, Sequence, ValuesView
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from dtrain.data.features import CategoricalColumn, RecordLayout, Records

from .tables import Table


def record_layout(features: Mapping[str, Any]) -> RecordLayout:
    """The packed record of a ``model.features`` section (a dumped dict)."""
    return RecordLayout(
        dense=tuple(features.get("dense") or ()),
        categorical=tuple(CategoricalColumn(f["name"], int(f.get("max_ids", 1)), bool(f.get("weighted", False)))
                          for f in features["categorical"]))


def _table_name(feature: Mapping[str, Any]) -> str:
    return feature.get("table") or feature["name"]


@dataclass
class Lookup:
    """What one batch's records look up: the records unpacked, each table's sorted unique rows
    (``ids``: weight name -> int64, on the CPU), and, when every feature's table is folded by
    modulo, ``index``: every feature's ids (in ``model.features`` order) as positions into the
    tables' unique rows side by side (torch.unique's inverse), the ``embedding_bag`` index of the
    table-batched forward, with ``order`` (the positions of ``index`` sorted by row, stable) and
    ``starts`` (where each row's run begins in ``order``): the bags' backward as a forward
    ``embedding_bag`` (:class:`_PooledRows`). Computed once for the ids a replica routes, reused by
    that batch's forward."""

    records: Records
    ids: dict[str, torch.Tensor]
    index: torch.Tensor | None = None
    order: torch.Tensor | None = None
    starts: torch.Tensor | None = None


class FeatureTables(nn.ModuleDict):
    """The tables of ``model.tables`` by name, and the features that look them up, pooled per
    example. A model holds it as ``tables``: its weights are ``tables.<name>.weight``."""

    if TYPE_CHECKING:  # every value is a Table (nn.ModuleDict's types say any Module)
        def __getitem__(self, key: str) -> Table: ...
        def items(self) -> ItemsView[str, Table]: ...
        def values(self) -> ValuesView[Table]: ...

    def __init__(self, features: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]], seed: int = 0,
                 gathered: bool = False, device: torch.device | str | None = None):
        super().__init__({
            name: Table(int(t.get("num_embeddings") or 0), int(t["dim"]), kind="embedding_bag",
                        mode=t.get("pooling", "sum"), init_std=float(t.get("init_std", 0.01)),
                        name=f"tables.{name}.weight", seed=seed, gathered=gathered, device=device, init="per_id",
                        dynamic=_dynamic(t), **_row_settings(t))
            for name, t in tables.items()})
        self.layout = record_layout(features)
        self.features = [(f["name"], _table_name(f)) for f in features["categorical"]]
        self._modulo = {name: int(t["num_embeddings"]) for name, t in tables.items()
                        if t.get("num_embeddings") and t.get("fold", "modulo") == "modulo"}
        # lookup's one pass: each read modulo table's rows shifted to a range of their own, in table order
        read = {t for _f, t in self.features}
        self._shift: dict[str, int] = {}
        start = 0
        for name in self:
            if name in self._modulo and name in read:
                self._shift[name], start = start, start + self._modulo[name]
        # (on the CPU, built under any device context: not buffers, no state to save or ship)
        self._starts = torch.tensor([*self._shift.values(), start], dtype=torch.int64, device="cpu")
        self._shifted = [f for f, t in self.features if t in self._shift]
        # per shifted feature: its table's fold (the modulo) and the start of its shifted range
        self._folding = torch.tensor([[self._modulo[t] for _f, t in self.features if t in self._shift],
                                      [self._shift[t] for _f, t in self.features if t in self._shift]],
                                     dtype=torch.int64, device="cpu").view(2, -1)

    def fold(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``table`` that ``ids`` (non-negative int64) look up."""
        n = self._modulo.get(table)
        return ids if n is None else torch.remainder(ids, n)

    def table_ids(self, records: Records) -> dict[str, torch.Tensor]:
        """Per table weight name: the sorted unique rows (on the CPU) the records look up."""
        return self.lookup(records).ids

    def lookup(self, records: Records) -> Lookup:
        """The rows the records look up (:class:`Lookup`). The tables folded by modulo are sorted
        together in one pass (each table's rows shifted into a range of its own, every feature's ids
        at once), the others one by one."""
        found: dict[str, list[torch.Tensor]] = {name: [] for name in self if name not in self._shift}
        for feature, table in self.features:
            if table in found:
                found[table].append(self.fold(table, records.features[feature][0]))
        out = {name: torch.unique(torch.cat(ids).cpu()) if ids else torch.empty(0, dtype=torch.int64)
               for name, ids in found.items()}
        index = order = starts = None
        if self._shift:
            read = [records.features[f][0] for f in self._shifted]
            flat = torch.cat(read)
            sizes = torch.tensor([len(i) for i in read], device=flat.device)
            folds, bases = self._folding.to(flat.device).repeat_interleave(sizes, dim=1, output_size=len(flat))
            keys = torch.remainder(flat, folds) + bases
            # a stable sort and its runs, rather than torch.unique: the same rows and inverse, and the
            # order by row the bags' backward sums in (the two: 590 us a batch of 15,552 keys, where
            # torch.unique and index_add_ take 720 us)
            keys, order = torch.sort(keys, stable=True)
            rows, inverse_sorted, counts = torch.unique_consecutive(keys, return_inverse=True, return_counts=True)
            rows = rows.cpu()
            tables = torch.diff(torch.searchsorted(rows, self._starts))
            out.update(zip(self._shift, (rows - self._starts[:-1].repeat_interleave(tables)).split(tables.tolist()),
                           strict=True))
            if len(read) == len(self.features):  # every row side by side, in table order: inverse indexes them
                index = torch.empty_like(inverse_sorted).scatter_(0, order, inverse_sorted)
                starts = torch.cumsum(counts, 0) - counts
            else:
                order = None
        ids = {f"tables.{name}.weight": out.get(name, torch.empty(0, dtype=torch.int64)) for name in self}
        return Lookup(records, ids, index, order, starts)

    def forward(self, records: Records, lookup: Lookup | None = None) -> list[torch.Tensor]:
        """The pooled rows of every feature, in ``model.features`` order: each (batch, dim).
        ``lookup``: the records' :meth:`lookup` (its index serves while the tables hold its rows)."""
        if self._batchable():
            return list(self._batched(records, lookup).unbind(0))
        return self._each(records)

    def stacked(self, records: Records, lookup: Lookup | None = None) -> torch.Tensor:
        """:meth:`forward`'s pooled rows as one (features, batch, dim) tensor (the tables of one width)."""
        if self._batchable():
            return self._batched(records, lookup)
        return torch.stack(self._each(records))

    def _batchable(self) -> bool:
        tables = list(self.values())
        return bool(tables) and all(t.gathered for t in tables) and len({t.dim for t in tables}) == 1

    def _each(self, records: Records) -> list[torch.Tensor]:
        out = []
        for feature, table in self.features:
            ids, offsets, weights = records.features[feature]
            out.append(self[table](self.fold(table, ids), offsets=offsets, per_sample_weights=weights))
        return out

    def _batched(self, records: Records, lookup: Lookup | None = None) -> torch.Tensor:
        """:meth:`stacked` for gathered tables of one width, as FBGEMM's table-batched bags do it: every
        table's gathered rows side by side, every feature's bags in one ``embedding_bag`` (mean pooling
        as a sum weighted by 1 / the bag's length); the rows' gradients reach each table's leaf.
        ``lookup``: when its tables' rows are the ones gathered, its index (the bags' positions into
        those rows) and that index's order by row serve; otherwise the ids are searched."""
        tables = list(self.values())
        base, start = {}, 0
        for name, t in self.items():
            if t.ids is None or t.rows is None:
                raise RuntimeError(f"table {t.name}: no rows gathered for this step")
            base[name], start = start, start + len(t.ids)
        index, order = None, None
        if lookup is not None and lookup.index is not None and all(lookup.ids[t.name] is t.ids for t in tables):
            index = lookup.index
            if lookup.order is not None and lookup.starts is not None:
                order = (lookup.order, lookup.starts)
        rows = torch.cat([t.rows for t in tables if t.rows is not None])  # (every table's: checked above)
        weighted = any(records.features[f][2] is not None or self[t].mode == "mean" for f, t in self.features)
        parts, starts_of, firsts, folded, weights, total = [], [], [], [], [], 0
        for feature, table in self.features:
            ids, starts, w = records.features[feature]
            if index is None:
                f = self.fold(table, ids)
                folded.append(f)
                gathered = self[table].ids
                assert gathered is not None  # (checked above)
                parts.append(torch.searchsorted(gathered, f) + base[table])
            starts_of.append(starts)
            firsts.append(total)
            total += len(ids)
            if weighted:
                if self[table].mode == "mean":  # (sum and mean share one bag call: mean is a weighted sum)
                    sizes = torch.diff(starts, append=torch.tensor([len(ids)], device=starts.device))
                    w = torch.repeat_interleave(1.0 / sizes.clamp(min=1).to(rows.dtype), sizes)
                weights.append(w if w is not None else torch.ones(len(ids), dtype=rows.dtype, device=rows.device))
        if index is None:
            index = torch.cat(parts)
            known = torch.cat([t.ids for t in tables if t.ids is not None])  # (every table's: checked above)
            folded_t = torch.cat(folded)
            if index.numel() and (int(index.max()) >= len(known) or not bool((known[index] == folded_t).all())):
                raise RuntimeError("the batch has ids that were not gathered for their tables")
        # every feature's bags at once: each feature's offsets moved past the ids of the features before it
        offsets = torch.stack(starts_of) + torch.tensor(firsts, device=index.device).unsqueeze(1)
        pooled = pooled_rows(rows, index, offsets.view(-1), torch.cat(weights) if weighted else None, order)
        return pooled.view(*offsets.shape, -1)


class _PooledRows(torch.autograd.Function):
    """``embedding_bag(index, rows, offsets, mode="sum", per_sample_weights)`` with a cheaper
    backward than torch's dense ``embedding_bag`` one, which sorts the index first (several times
    the cost for a step's few thousand gathered rows). With ``order`` (the positions of ``index``
    sorted by row, stable, and where each row's run starts, from the lookup's sort) the rows'
    gradient is itself a forward ``embedding_bag``: row ``r`` sums the gradients of the bags of its
    positions, in position order (33 us for 15,552 ids into 2,605 rows of 16, where ``index_add_``
    takes 180 us). Without it, one ``index_add_`` adds each bag's gradient into its rows. The
    weights take no gradient (they are data)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor | None, order: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        sizes = torch.diff(offsets, append=offsets.new_tensor([len(index)]))
        ctx.save_for_backward(index, torch.repeat_interleave(sizes), weights)
        ctx.num_rows = len(rows)
        ctx.order = order
        return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        index, bags, weights = ctx.saved_tensors
        if ctx.order is not None:
            order, starts = ctx.order
            if weights is not None:
                weights = weights.index_select(0, order)
            out = F.embedding_bag(bags.index_select(0, order), grad.contiguous(), starts, mode="sum",
                                  per_sample_weights=weights)
            return out, None, None, None, None
        per_id = grad.index_select(0, bags)
        if weights is not None:
            per_id = per_id * weights.unsqueeze(1)
        out = grad.new_zeros(ctx.num_rows, grad.shape[1])
        out.index_add_(0, index, per_id)
        return out, None, None, None, None


def pooled_rows(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor | None = None,
                order: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The bags' sums of ``rows[index]`` (``weights`` per index, when given), bag ``b`` holding
    ``index[offsets[b]:offsets[b + 1]]``: ``F.embedding_bag``'s sum with a cheaper backward.
    ``order``: ``index``'s positions sorted by row (stable) and the start of each row's run in
    them (:class:`Lookup`), for the cheapest backward."""
    if not rows.requires_grad:
        return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)
    return _PooledRows.apply(rows, index, offsets, weights, order)


class _DotInteraction(torch.autograd.Function):
    """DLRM's ``dot`` interaction and its concatenation: with ``S`` the bottom output ``dense``
    (batch, dim) and the pooled rows ``pooled`` (features, batch, dim) stacked per example
    (batch, features + 1, dim), ``cat([dense, (S @ S^T).flatten(1)[:, pairs]], 1)``.

    Backward: the pairs' gradient ``G`` (the strictly lower triangle) reaches ``S`` as
    ``G @ S + G^T @ S``, computed as one ``(G + G^T) @ S``: the symmetric matrix is spread from
    the pairs' gradient by one ``index_select`` (``spread``: per product position, 0 on the
    diagonal, else 1 + its pair), as the pairs are unique and never overlap their transposes. At
    batch 512 with 27 vectors of 16 (measured, one thread): 360 us, where autograd's backward of
    the plain expression takes 1.3 ms (two ``bmm``, zeros and an ``index_add_`` for the
    ``index_select``, and the sum of the two ``bmm`` gradients). Only rounding differs: each
    gradient is one sum over ``k`` of ``(G + G^T)[i, k] S[k]`` instead of two sums added."""

    @staticmethod
    def forward(ctx: Any, dense: torch.Tensor, pooled: torch.Tensor, pairs: torch.Tensor,
                spread: torch.Tensor) -> torch.Tensor:
        stacked = torch.cat([dense.unsqueeze(1), pooled.transpose(0, 1)], dim=1)  # (batch, features + 1, dim)
        products = torch.bmm(stacked, stacked.transpose(1, 2))
        ctx.save_for_backward(stacked, spread)
        return torch.cat([dense, products.flatten(1).index_select(1, pairs)], dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        stacked, spread = ctx.saved_tensors
        b, n, d = stacked.shape
        paired = torch.cat([grad.new_zeros(b, 1), grad[:, d:]], dim=1).index_select(1, spread)
        grads = torch.bmm(paired.view(b, n, n), stacked)
        return grad[:, :d] + grads[:, 0], grads[:, 1:].transpose(0, 1), None, None


def _dynamic(table: Mapping[str, Any]) -> dict[str, Any] | None:
    """A table without a vocabulary's settings (``dtrain.ps.dynamic``), or None for a fixed table."""
    if table.get("num_embeddings"):
        return None
    return {"max_rows": int(table["max_rows"]), "min_count": int(table.get("min_count", 1)),
            "ttl_steps": table.get("ttl_steps"), "policy": table.get("eviction", "lru")}


def _row_settings(table: Mapping[str, Any]) -> dict[str, Any]:
    """What a ps task needs beyond the shape: row storage and the table's own optimizer, when set."""
    settings: dict[str, Any] = {}
    if table.get("storage", "float32") != "float32":
        settings["storage"] = table["storage"]
    if table.get("optimizer") is not None:
        settings["optimizer"] = dict(table["optimizer"])
    return settings


def _mlp(widths: Sequence[int], first: int, last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(first if i == 0 else widths[i - 1], width))
        if last_activation or i < len(widths) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019): ``bottom`` MLP over the dense features; its output and every
    feature's pooled rows crossed by ``interaction`` (``dot``: each pair's dot product once, the
    strictly lower triangle, after the bottom output; ``cat``: all concatenated); ``top`` MLP to the
    logits. Input: records packed by :func:`record_layout`."""

    def __init__(self, features: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]],
                 dlrm: Mapping[str, Any], seed: int = 0, gathered: bool = False,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tables = FeatureTables(features, tables, seed=seed, gathered=gathered, device=device)
        self.layout = self.tables.layout
        bottom, top = list(dlrm["bottom"]), list(dlrm["top"])
        self.interaction = dlrm.get("interaction", "dot")
        self.bottom = _mlp(bottom, len(self.layout.dense), last_activation=True)
        dims = [int(tables[t]["dim"]) for _, t in self.tables.features]
        if self.interaction == "dot":
            n = len(dims) + 1
            crossed = bottom[-1] + n * (n - 1) // 2
            # The pairs (i > j), as positions in the flattened (n, n) products, and their spread to
            # both triangles (_DotInteraction). Not buffers: no state to save or ship.
            rows, cols = torch.tril_indices(n, n, offset=-1, device="cpu")
            self._pairs = rows * n + cols
            self._spread = torch.zeros(n * n, dtype=torch.int64, device="cpu")
            self._spread[self._pairs] = torch.arange(1, len(rows) + 1, device="cpu")
            self._spread[cols * n + rows] = self._spread[self._pairs]
        else:
            crossed = bottom[-1] + sum(dims)
        self.top = _mlp(top, crossed, last_activation=False)
        self._ahead: list[tuple[torch.Tensor, int, Lookup]] = []  # table_ids' batches (two at most), for their forward

    def table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per table weight name: the sorted unique rows the batch ``x`` looks up (no forward pass).
        The lookup is kept for ``x``'s forward, which then neither unpacks the records again nor
        searches the gathered ids (a replica routes a batch's ids one or two steps before it computes on
        it)."""
        lookup = self.tables.lookup(self.layout.unpack(x))
        # Keyed on the tensor itself (held, so its identity cannot pass to another) and its version
        # counter: a batch buffer refilled in place (MemoryBatches alternates two) misses. Two kept:
        # a replica routes the batch after next while the next one waits for its rows.
        self._ahead = [*self._ahead[-1:], (x, x._version, lookup)]
        return lookup.ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lookup = None
        for i, (held, version, found) in enumerate(self._ahead):
            if held is x and version == x._version:
                lookup = found
                del self._ahead[:i + 1]  # (and any older: never computed on)
                break
        records = lookup.records if lookup is not None else self.layout.unpack(x)
        dense = self.bottom(records.dense)
        if self.interaction == "dot":
            pooled = self.tables.stacked(records, lookup)  # (features, batch, dim)
            if self._pairs.device != pooled.device:
                self._pairs, self._spread = self._pairs.to(pooled.device), self._spread.to(pooled.device)
            crossed = _DotInteraction.apply(dense, pooled, self._pairs, self._spread)
        else:
            crossed = torch.cat([dense, *self.tables(records, lookup)], dim=1)
        return self.top(crossed)


def build_dlrm(features: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]], dlrm: Mapping[str, Any],
               device: str | torch.device = "cpu", seed: int | None = None, gathered_tables: bool = False) -> DLRM:
    """The DLRM of a pipeline's ``model`` section (dumped dicts), initialised from ``seed`` like
    ``model.layers`` (``"meta"``: a skeleton without storage)."""
    from .layers import init_parameters

    with torch.random.fork_rng(devices=[]), torch.device(device):
        model = DLRM(features, tables, dlrm, seed=seed or 0, gathered=gathered_tables, device=device)
    if seed is not None and torch.device(device).type != "meta":
        init_parameters(model, seed)
    return model


def feed_features(module: nn.Module, features: Mapping[str, Any]) -> nn.Module:
    """A ``model.module`` with ``model.features``: it is called with the packed records and its
    ``forward(dense, features)`` receives the dense tensor and, per feature name, ``(ids, offsets,
    per_sample_weights)`` (``nn.EmbeddingBag``'s convention). Each feature's ids go unchanged to the
    sparse embedding its ``table`` names (the module's attribute path, e.g. ``emb.users``), so the
    rows a batch needs are known from the records (``module.table_ids``): no record pass. Parameter
    names stay the module's own (``model.pt`` loads into the user's class). ValueError naming the
    feature for a table that is not one of the module's sparse embeddings."""
    from .tables import tables_of

    layout = record_layout(features)
    held = {name.removesuffix(".weight").removesuffix("weight").rstrip("."): name for name, _ in tables_of(module)}
    routes: dict[str, list[str]] = {}
    for f in features["categorical"]:
        table = _table_name(f)
        if table not in held:
            raise ValueError(f"feature {f['name']!r} looks up {table!r}, which is not one of the module's sparse "
                             f"embeddings ({', '.join(sorted(held)) or 'none'}): set the feature's table: to one of "
                             "them (an nn.Embedding or nn.EmbeddingBag built with sparse=True)")
        routes.setdefault(held[table], []).append(f["name"])

    def unpack(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        records = layout.unpack(args[0])
        return (records.dense, records.features)

    def table_ids(x: torch.Tensor) -> dict[str, torch.Tensor]:
        records = layout.unpack(x)
        return {weight: torch.unique(torch.cat([records.features[f][0] for f in names]).cpu())
                for weight, names in routes.items()}

    module.register_forward_pre_hook(unpack)
    setattr(module, "table_ids", table_ids)  # noqa: B010 (an instance attribute: the worker's router asks for it)
    setattr(module, "layout", layout)  # noqa: B010 (nn.Module's types take tensors and modules only)
    return module
