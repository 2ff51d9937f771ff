"""Flat shard buffers <-> a model's parameters. Pure torch (no Dask).

Each shard holds its variables as one contiguous float32 buffer; a :class:`ShardLayout` knows,
from the Plan, which slice of which parameter every part of every shard buffer is. Replicas keep
one persistent parameter buffer and two alternating gradient buffers per shard (fresh multi-MB
tensors every step cost page faults), so a step allocates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the compiler imports this module
    from .compiler import Plan, VariablePlan


@dataclass(frozen=True)
class Part:
    """A variable's part: ``numel`` elements at ``offset`` in a shard buffer, holding elements of the
    flattened parameter from ``start``: one run (``blocks == 1``), or, for a part split along an inner
    axis (plan/partitioners.py), ``blocks`` equal runs ``stride`` elements apart."""

    shard: int
    offset: int  # in the shard buffer
    numel: int
    param: str
    start: int  # in the flattened parameter
    blocks: int = 1
    stride: int = 0

    @property
    def end(self) -> int:
        """One past the last element of the flattened parameter that the part holds."""
        return self.start + (self.blocks - 1) * self.stride + self.numel // self.blocks

    def of_param(self, flat: torch.Tensor) -> torch.Tensor:
        """The part's elements as a view of the flattened parameter: 1-D, or ``(blocks, run)``."""
        if self.blocks == 1:
            return flat[self.start:self.start + self.numel]
        return flat[self.start:self.end].unfold(0, self.numel // self.blocks, self.stride)

    def of_buffer(self, buf: torch.Tensor) -> torch.Tensor:
        """The part's elements in a shard buffer, shaped as :meth:`of_param`."""
        view = buf[self.offset:self.offset + self.numel]
        return view if self.blocks == 1 else view.view(self.blocks, -1)


def part_of(v: VariablePlan, shard: int) -> Part:
    """A plan variable's :class:`Part` on ``shard`` (its index in the layout at hand)."""
    return Part(shard, v.offset, v.numel, v.source, v.start, v.blocks, v.stride)


class ShardLayout:
    """The mapping between parameters and shard buffers (built from ``Plan.variables``)."""

    def __init__(self, parts: Sequence[Part], shard_numel: Sequence[int]):
        self.parts = list(parts)
        self.shard_numel = list(shard_numel)

    @classmethod
    def from_plan(cls, plan: Plan) -> ShardLayout:
        return cls([part_of(v, v.shard) for v in plan.variables], [s.numel for s in plan.shards])

    @property
    def num_shards(self) -> int:
        return len(self.shard_numel)

    def buckets(self, shard: int, bucket_numel: int) -> list[tuple[int, int, list[str]]]:
        """Gradient buckets of ``shard`` for pushes during backward: ``(lo, hi, params)`` ranges of
        the shard buffer, from its end to its start (backward produces the last layers' gradients
        first), each at least ``bucket_numel`` elements unless it is the last, never splitting a
        part."""
        parts = sorted((p for p in self.parts if p.shard == shard), key=lambda p: p.offset, reverse=True)
        out: list[tuple[int, int, list[str]]] = []
        hi, names = self.shard_numel[shard], []
        for p in parts:
            names.append(p.param)
            if hi - p.offset >= bucket_numel:
                out.append((p.offset, hi, names))
                hi, names = p.offset, []
        if names:
            out.append((0, hi, names))
        return out

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Parameters (name -> tensor) -> one new flat float32 CPU buffer per shard."""
        out = [torch.zeros(n, dtype=torch.float32) for n in self.shard_numel]
        for p in self.parts:
            p.of_buffer(out[p.shard]).copy_(p.of_param(tensors[p.param].detach().reshape(-1)))
        return out

    def unpack(self, buffers: Sequence[torch.Tensor], shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Shard buffers -> parameters (name -> new CPU tensor of the given shape)."""
        flat = {name: torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
                for name, shape in shapes.items()}
        for p in self.parts:
            p.of_param(flat[p.param]).copy_(p.of_buffer(buffers[p.shard]))
        return {name: t.view(shapes[name]) for name, t in flat.items()}


    # ------------------------------------------------------------------ checkpoints
    def describe(self) -> dict[str, list[Any]]:
        """Plain data for a checkpoint (see :meth:`from_description`)."""
        return {"parts": [[p.shard, p.offset, p.numel, p.param, p.start] + ([p.blocks, p.stride] if p.blocks > 1 else [])
                          for p in self.parts],
                "shard_numel": list(self.shard_numel)}

    @classmethod
    def from_description(cls, data: Mapping[str, list[Any]]) -> ShardLayout:
        return cls([Part(int(s), int(o), int(n), str(name), int(st), *(int(x) for x in rest))
                    for s, o, n, name, st, *rest in data["parts"]],
                   [int(n) for n in data["shard_numel"]])

    def same_as(self, other: ShardLayout) -> bool:
        return self.parts == other.parts and self.shard_numel == other.shard_numel

    def unpack_flat(self, buffers: Sequence[torch.Tensor], numel: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Shard buffers -> each parameter as one flat tensor of ``numel[name]`` elements."""
        return self.unpack(buffers, {name: torch.Size([n]) for name, n in numel.items()})


def reshard(states: Sequence[Mapping[str, Any]], old: ShardLayout, new: ShardLayout) -> list[dict[str, Any]]:
    """Shard states written under ``old`` (``params``, ``optimizer_state``, ``step``, ...) -> states
    for the shards of ``new``: every variable and every per-element optimizer tensor (momentum,
    Adam's moments, Adagrad's sums) and the moving averages (``averages``) reassembled from its
    slices and placed anew, so a checkpoint
    resumes under another placement or number of ps tasks. Scalar optimizer state (Adam's and
    Adagrad's step count), the step and the counters come from the shard that holds the global
    step (shard 0). ValueError when the two layouts do not hold the same variables."""
    old_numel: dict[str, int] = {}
    for p in old.parts:
        old_numel[p.param] = max(old_numel.get(p.param, 0), p.end)
    new_numel: dict[str, int] = {}
    for p in new.parts:
        new_numel[p.param] = max(new_numel.get(p.param, 0), p.end)
    if old_numel != new_numel:
        raise ValueError(f"the layouts hold different variables: {sorted(old_numel.items())} against "
                         f"{sorted(new_numel.items())}")

    def regroup(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return new.pack(old.unpack_flat([b.reshape(-1).to(torch.float32) for b in buffers], old_numel))

    params = regroup([st["params"] for st in states])
    opt_states = [dict(st.get("optimizer_state") or {}) for st in states]
    elementwise = [k for k, v in opt_states[0].items() if isinstance(v, torch.Tensor)
                   and all(isinstance(s.get(k), torch.Tensor) and s[k].numel() == n
                           for s, n in zip(opt_states, old.shard_numel, strict=True))]
    scalars = {k: v for k, v in opt_states[0].items() if not isinstance(v, torch.Tensor)}
    regrouped = {k: regroup([s[k] for s in opt_states]) for k in elementwise}
    # Moving averages (training.moving_average) are per element like the variables they shadow.
    averages = regroup([st["averages"] for st in states]) if all("averages" in st for st in states) else None
    head = states[0]
    return [{**{k: v for k, v in head.items() if k not in ("params", "optimizer_state", "averages")},
             "params": params[i], "optimizer_state": {**scalars, **{k: regrouped[k][i] for k in elementwise}},
             **({"averages": averages[i]} if averages is not None else {})}
            for i in range(new.num_shards)]


class BoundModel:
    """A model bound to persistent shard buffers: ``load_params`` copies received shard buffers
    into the parameters, ``grads_into`` copies the gradients into a shard-shaped buffer set."""

    def __init__(self, model: torch.nn.Module, layout: ShardLayout):
        self.model = model
        self.layout = layout
        params = dict(model.named_parameters())
        missing = {p.param for p in layout.parts} - params.keys()
        if missing:
            raise ValueError(f"the model has no parameter(s) {sorted(missing)} that the plan places; "
                             "was the plan compiled for another model?")
        # (flat parameter slice, shard, offset, numel), resolved once; parts split along an inner
        # axis (several runs of the parameter) apart, so the one-run fast path stays as it was.
        self._pairs = [(params[p.param], p.start, p.shard, p.offset, p.numel) for p in layout.parts if p.blocks == 1]
        self._strided = [(params[p.param], p) for p in layout.parts if p.blocks > 1]
        self.device = next(iter(params.values())).device if params else torch.device("cpu")
        # Zero-copy is possible when every parameter is one whole part on the CPU: parameters and
        # gradients can then be views into the shard buffers (DDP's gradient_as_bucket_view).
        self.zero_copy = self.device.type == "cpu" and all(
            p.start == 0 and p.numel == params[p.param].numel() for p in layout.parts)
        self._view_cache: dict[tuple[Any, ...], list[Any]] = {}

    def grads_as_views(self, bufs: Sequence[torch.Tensor]) -> None:
        """Make every ``param.grad`` a view into ``bufs`` (zeroed): backward then writes the
        shard-shaped gradient directly, and no copy is needed before a push."""
        for (param, *_), view in zip(self._pairs, self._views_of(-1, bufs), strict=True):
            param.grad = view
        for b in bufs:
            b.zero_()

    def params_as_views(self, shard: int, buf: torch.Tensor) -> None:
        """Make the parameters of ``shard`` views into a received buffer (which the caller owns
        until the next reply): no copy into the model."""
        for param, view in self._views_of(shard, [buf]):
            param.data = view

    def _views_of(self, shard: int, bufs: Sequence[torch.Tensor]) -> list[Any]:
        """The views of a buffer set, made once per set (the data plane alternates between two
        persistent sets of each kind; a view keeps its buffer alive, so a key is never reused
        while cached). ``shard`` -1: gradient views of every part; else (param, view) pairs of
        that shard's parts, ``bufs`` its one buffer."""
        key = (shard, *(b.data_ptr() for b in bufs), *(b.numel() for b in bufs))
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 16:  # (buffers that change every step: never reused)
                self._view_cache.clear()
            if shard < 0:
                views = [bufs[s][off:off + n].view(param.shape) for param, _start, s, off, n in self._pairs]
            else:
                views = [(param, bufs[0][off:off + n].view(param.shape))
                         for param, _start, s, off, n in self._pairs if s == shard]
            self._view_cache[key] = views
        return views

    def new_buffers(self) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=torch.float32) for n in self.layout.shard_numel]

    @torch.no_grad()
    def load_params(self, shard: int, buf: torch.Tensor) -> None:
        for param, start, s, off, n in self._pairs:
            if s == shard:
                param.view(-1)[start:start + n].copy_(buf[off:off + n], non_blocking=False)
        for param, p in self._strided:
            if p.shard == shard:
                p.of_param(param.view(-1)).copy_(p.of_buffer(buf))

    @torch.no_grad()
    def grads_into(self, bufs: Sequence[torch.Tensor]) -> None:
        for param, start, s, off, n in self._pairs:
            g = param.grad
            if g is None:
                bufs[s][off:off + n].zero_()
            else:
                bufs[s][off:off + n].copy_(g.view(-1)[start:start + n])
        for param, p in self._strided:
            g = param.grad
            if g is None:
                p.of_buffer(bufs[p.shard]).zero_()
            else:
                p.of_buffer(bufs[p.shard]).copy_(p.of_param(g.view(-1)))
