"""One ps task's part of a table without a vocabulary: any non-negative 64-bit id, a row created
the first time an admitted id is asked for, rows evicted by age or beyond a cap
(docs/recommendation.md, "Tables without a vocabulary").

- **Home**: an id lives on ps task ``mix64(id) % num_parts`` (``dtrain.model.ids``).
- **Rows**: slots of a (capacity, dim) tensor, found through an :class:`~dtrain.ps.idmap.IdMap`;
  a new row starts at ``id_rows(seed, table, id)`` (a function of the id alone, so the ps count
  and the arrival order do not change it), and its optimizer state at the optimizer's initial
  value. Capacity grows by doubling up to the part's cap.
- **Admission** (``min_count``): an id asked for fewer than ``min_count`` times (once per request
  that names it: a replica's batch, counted in a count-min sketch, which can only over-count) has
  no row: it reads zeros and its gradient is dropped (counted as ``rejected``).
- **Eviction**: rows not touched (looked up or updated) for ``ttl_steps`` applied steps, checked
  every ``ceil(ttl_steps / 16)`` steps; and when a new row would pass ``max_rows`` (this part's
  share: ``ceil(max_rows / num_parts)``), the least recently (``lru``) or least frequently
  (``lfu``) used rows, down to 15/16 of the cap, so eviction runs in batches.

The interface is :class:`~dtrain.ps.rows.TablePart`'s. Pure torch and numpy: no Dask.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dtrain.model.ids import home_part, id_rows

from .idmap import IdMap
from .rows import STORAGE, _stream_seed, make_row_optimizer, round_stochastic, sum_rows

SKETCH_DEPTH = 2
EMPTY_ID = -1


class CountMinSketch:
    """Per-id counts in ``depth`` rows of ``width`` int32 counters: the minimum over the rows, never
    less than the true count."""

    def __init__(self, width: int, seed: int):
        self.width = 1 << max(10, math.ceil(math.log2(max(width, 1))))
        self.counts = np.zeros((SKETCH_DEPTH, self.width), dtype=np.int32)
        self.salts = [np.uint64(0x9E3779B97F4A7C15 * (seed + 2 * r + 1) % 2**64) for r in range(SKETCH_DEPTH)]

    def _cells(self, ids: np.ndarray) -> list[np.ndarray]:
        from dtrain.model.ids import mix64

        with np.errstate(over="ignore"):
            return [(mix64((ids.view(np.uint64) ^ salt).view(np.int64)) & np.uint64(self.width - 1)).astype(np.int64)
                    for salt in self.salts]

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count each of ``ids`` (unique) once; their counts after."""
        cells = self._cells(ids)
        for row, c in enumerate(cells):
            np.add.at(self.counts[row], c, 1)
        return np.min([self.counts[row][c] for row, c in enumerate(cells)], axis=0)


class DynamicTablePart:
    """This ps task's rows of a table without a vocabulary (see the module docstring)."""

    def __init__(self, name: str, dim: int, num_parts: int, part: int, init_std: float, seed: int,
                 optimizer_config: dict[str, Any], max_rows: int, min_count: int = 1, ttl_steps: int | None = None,
                 policy: str = "lru", storage: str = "float32", track: bool = False, **_: Any):
        self.name, self.dim, self.storage = name, int(dim), storage
        self.num_parts, self.part = int(num_parts), int(part)
        self.init_std, self.seed = float(init_std), int(seed)
        self.cap = max(1, -(-int(max_rows) // self.num_parts))
        self.min_count, self.ttl_steps, self.policy = int(min_count), ttl_steps, policy
        self.optimizer_config = dict(optimizer_config)
        self._fresh = make_row_optimizer(1, self.dim, self.optimizer_config).tensors()  # one row's initial state
        self._generator = torch.Generator()  # stochastic rounding's bits (bfloat16, float16 storage)
        self.index = IdMap()
        self.clock = 0  # applied steps
        self.sketch = CountMinSketch(4 * self.cap, seed) if self.min_count > 1 else None
        self.counters = {"admitted": 0, "evicted": 0, "rejected": 0}
        # Incremental checkpoints (``track``): the slots written since the last snapshot and the
        # ids evicted since (``delta_state``).
        self.track = bool(track)
        self.evicted: list[np.ndarray] = []
        self._alloc(min(self.cap, 1 << 12))
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------------------------ storage

    def _alloc(self, capacity: int) -> None:
        self.weight = torch.zeros((capacity, self.dim), dtype=STORAGE[self.storage])
        self.ids = np.full(capacity, EMPTY_ID, dtype=np.int64)  # slot -> id
        self.last = np.zeros(capacity, dtype=np.int64)  # slot -> the step it was last touched
        self.freq = np.zeros(capacity, dtype=np.int64)  # slot -> touches
        self.free = list(range(capacity - 1, -1, -1))
        self.optimizer = make_row_optimizer(capacity, self.dim, self.optimizer_config)
        self.changed = np.zeros(capacity if self.track else 0, dtype=bool)  # slot -> written since the snapshot

    def _grow(self, need: int) -> None:
        old = len(self.ids)
        new = min(self.cap, max(2 * old, need))
        weight, ids, last, freq = self.weight, self.ids, self.last, self.freq
        state = self.optimizer.state_dict()
        self.weight = torch.zeros((new, self.dim), dtype=weight.dtype)
        self.weight[:old] = weight
        self.ids = np.concatenate([ids, np.full(new - old, EMPTY_ID, np.int64)])
        self.last = np.concatenate([last, np.zeros(new - old, np.int64)])
        self.freq = np.concatenate([freq, np.zeros(new - old, np.int64)])
        if self.track:
            self.changed = np.concatenate([self.changed, np.zeros(new - old, bool)])
        self.free = list(range(new - 1, old - 1, -1)) + self.free
        self.optimizer = make_row_optimizer(new, self.dim, self.optimizer_config)
        self.optimizer.load_state_dict(_pad_rows(state, old, self.optimizer.tensors()))

    @property
    def live_rows(self) -> int:
        return self.index.size

    # ------------------------------------------------------------------------------ rows

    def check_ids(self, ids: torch.Tensor | None) -> str | None:
        if ids is None or not len(ids):
            return None
        if bool((ids < 0).any()):
            return f"id {int(ids[ids < 0][0])} is negative: table {self.name} takes ids 0 .. 2**63 - 1"
        wrong = home_part(ids, self.num_parts) != self.part
        if bool(wrong.any()):
            return f"id {int(ids[wrong][0])} is not on ps part {self.part} of table {self.name}"
        return None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``, zeros for those without one; no side effect (evaluation)."""
        slots = self.index.get(ids.numpy().astype(np.int64, copy=False))
        out = torch.zeros((len(ids), self.dim), dtype=torch.float32)
        have = torch.from_numpy(slots >= 0)
        out[have] = self.weight[torch.from_numpy(slots[slots >= 0])].to(torch.float32)
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """A replica's request for the next batch's rows: counts the ids, admits those that reached
        ``min_count`` (creating their rows), and returns the rows (zeros where not admitted)."""
        arr = ids.numpy().astype(np.int64, copy=False)
        slots = self.index.get(arr)
        self.last[slots[slots >= 0]] = self.clock  # (first: an eviction for the new rows spares these)
        new = slots < 0
        if new.any():
            candidates = arr[new]
            if self.sketch is not None:
                candidates = candidates[self.sketch.add(candidates) >= self.min_count]
            if len(candidates):
                self._create(candidates)
                slots = self.index.get(arr)
        have = slots >= 0
        self.freq[slots[have]] += 1
        if self.track:
            self.changed[slots[have]] = True
        out = torch.zeros((len(ids), self.dim), dtype=torch.float32)
        out[torch.from_numpy(have)] = self.weight[torch.from_numpy(slots[have])].to(torch.float32)
        return out

    def _create(self, ids: np.ndarray) -> None:
        """Rows for ``ids`` (unique, absent), evicting first when the cap requires it."""
        ids = ids[: self.cap]  # (a single request larger than the whole cap keeps its first rows)
        if not len(ids):
            return
        if self.index.size + len(ids) > self.cap:
            self._evict_for(self.index.size + len(ids) - self.cap)
        if len(self.free) < len(ids):
            self._grow(self.index.size + len(ids))
        slots = np.array(self.free[-len(ids):][::-1], dtype=np.int64)  # (as pops from the end would take them)
        del self.free[-len(ids):]
        self.index.put(ids, slots)
        self.ids[slots] = ids
        self.last[slots] = self.clock
        self.freq[slots] = 0
        t = torch.from_numpy(slots)
        self.weight[t] = id_rows(self.seed, self.name, ids, self.dim, self.init_std).to(self.weight.dtype)
        for key, value in self.optimizer.tensors().items():  # a new row's state starts afresh
            value[t] = self._fresh[key][0]
        self.counters["admitted"] += len(ids)

    def _evict(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        self.index.remove(self.ids[slots])
        if self.track:
            self.evicted.append(self.ids[slots].copy())
        self.ids[slots] = EMPTY_ID
        self.free.extend(slots.tolist())
        self.counters["evicted"] += len(slots)

    def _evict_for(self, count: int) -> None:
        """Make room for ``count`` rows: the least recently / frequently used, down to 15/16 of the cap."""
        live = np.flatnonzero(self.ids >= 0)
        count = min(len(live), max(count, count + self.cap // 16))
        key = self.last[live] if self.policy == "lru" else self.freq[live]
        self._evict(live[np.argpartition(key, count - 1)[:count]] if count < len(live) else live)

    def add_grad(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One replica's row gradients; ids without a row (not admitted, or evicted since) are dropped."""
        slots = self.index.get(ids.numpy().astype(np.int64, copy=False))
        have = slots >= 0
        self.counters["rejected"] += int((~have).sum())
        if have.any():
            t = torch.from_numpy(slots[have])
            self._pending.append((t, grads.to(torch.float32)[torch.from_numpy(have)]))
            self.last[slots[have]] = self.clock
            if self.track:
                self.changed[slots[have]] = True

    def clear(self) -> None:
        self._pending = []

    def apply(self, scale: float = 1.0) -> None:
        """One optimizer step with the step's gradients summed per row and multiplied by ``scale``."""
        if self._pending:
            rows, summed = sum_rows(self._pending, self.dim, scale)
        else:
            rows, summed = torch.empty(0, dtype=torch.int64), torch.empty((0, self.dim))
        self._pending = []
        w = self.weight.index_select(0, rows).to(torch.float32)
        self.optimizer.step(w, rows, summed)
        if self.weight.dtype != torch.float32:  # as a fixed part rounds (dtrain.ps.rows)
            self._generator.manual_seed(_stream_seed(self.seed, self.name, self.part, self.optimizer.step_count))
            w = round_stochastic(w, self.weight.dtype, self._generator)
        self.weight.index_copy_(0, rows, w)
        self.clock += 1
        if self.ttl_steps and self.clock % max(1, -(-self.ttl_steps // 16)) == 0:
            live = np.flatnonzero(self.ids >= 0)
            self._evict(live[self.last[live] < self.clock - self.ttl_steps])

    # ------------------------------------------------------------------------------ state

    def stats(self) -> dict[str, int]:
        return {"live_rows": self.live_rows, **self.counters, "bytes": self.nbytes, "capacity": len(self.ids)}

    def state(self, copy: bool = False) -> dict[str, Any]:
        return self.chunk(0, len(self.ids))

    def chunk(self, start: int, stop: int) -> dict[str, Any]:
        """The live rows among slots ``[start, stop)``: their ids, rows, optimizer state, last use
        and use counts; the step count and the counters whole."""
        slots = np.arange(start, min(stop, len(self.ids)))
        slots = slots[self.ids[slots] >= 0]
        t = torch.from_numpy(slots)
        state = self.optimizer.state_dict()
        return {"ids": torch.from_numpy(self.ids[slots].copy()), "weight": self.weight[t].clone(),
                "last": torch.from_numpy(self.last[slots].copy()), "freq": torch.from_numpy(self.freq[slots].copy()),
                "optimizer": {k: v[t].clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
                "clock": self.clock, "counters": dict(self.counters)}

    def delta_state(self) -> dict[str, Any]:
        """The live rows written (created, updated, looked up) since :meth:`mark_clean`, as
        :meth:`chunk` gives them, and the ids evicted since (``evicted``; an id evicted and admitted
        again is in both): an incremental checkpoint's part, built in its copy-on-write writer."""
        if not self.track:
            raise ValueError(f"table {self.name}: changes are not tracked (checkpoint.incremental is not set)")
        slots = np.flatnonzero(self.changed & (self.ids >= 0))
        t = torch.from_numpy(slots)
        state = self.optimizer.state_dict()
        evicted = np.concatenate(self.evicted) if self.evicted else np.zeros(0, np.int64)
        return {"delta": True, "ids": torch.from_numpy(self.ids[slots].copy()), "weight": self.weight[t].clone(),
                "last": torch.from_numpy(self.last[slots].copy()), "freq": torch.from_numpy(self.freq[slots].copy()),
                "optimizer": {k: v[t].clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
                "clock": self.clock, "counters": dict(self.counters), "evicted": torch.from_numpy(evicted)}

    def mark_clean(self) -> None:
        """Nothing counts as changed: a snapshot was taken (the next delta holds what changes after
        it), or the part was just restored."""
        if self.track:
            self.changed[:] = False
            self.evicted = []

    snapshot_taken = mark_clean  # (a part's slots are few: cleared under the hold, as TablePart's are not)

    def load_delta(self, state: dict[str, Any]) -> None:
        """Apply :meth:`delta_state`'s output over the rows restored from the checkpoint it follows
        (evicted ids removed, then each row written where its id is, or in a new slot); rows whose
        id lives on another part are skipped, as :meth:`load_state` skips them."""
        gone = np.unique(state["evicted"].numpy().astype(np.int64, copy=False))  # (an id may go twice)
        slots = self.index.get(gone)
        slots = slots[slots >= 0]
        if len(slots):
            self.index.remove(self.ids[slots])
            self.ids[slots] = EMPTY_ID
            self.free.extend(slots.tolist())
        ids = state["ids"].to(torch.int64)
        mine = ((ids >= 0) & (home_part(ids, self.num_parts) == self.part) if len(ids)
                else torch.zeros(0, dtype=torch.bool))
        ids = ids[mine].numpy()
        slots = self.index.get(ids)
        new = slots < 0
        if new.any():
            if self.index.size + int(new.sum()) > self.cap:
                raise ValueError(f"table {self.name} part {self.part}: a delta brings its rows past the cap of "
                                 f"{self.cap} (max_rows lowered?)")
            if len(self.free) < int(new.sum()):
                self._grow(self.index.size + int(new.sum()))
            fresh = np.array(self.free[-int(new.sum()):][::-1], dtype=np.int64)
            del self.free[-int(new.sum()):]
            self.index.put(ids[new], fresh)
            self.ids[fresh] = ids[new]
            slots[new] = fresh
        t = torch.from_numpy(slots)
        self.weight[t] = state["weight"][mine].to(self.weight.dtype)
        self.last[slots] = state["last"][mine].numpy()
        self.freq[slots] = state["freq"][mine].numpy()
        opt = dict(state.get("optimizer") or {})
        per_row = self.optimizer.tensors()
        for key, value in opt.items():
            if key in per_row and isinstance(value, torch.Tensor):
                per_row[key][t] = value[mine].to(per_row[key].dtype)
        self.optimizer.step_count = int(opt.get("step", self.optimizer.step_count))
        self.clock = int(state.get("clock", self.clock))
        self.counters = {"admitted": 0, "evicted": 0, "rejected": 0, **dict(state.get("counters") or {})}
        self._pending = []

    def live_state(self) -> dict[str, Any]:
        """Every slot (a free one's id is -1) with its row, optimizer state, last use and use count,
        the live arrays themselves (no copy: a checkpoint's part, written from a copy-on-write
        snapshot); :meth:`load_state` keeps the slots in use."""
        return {"ids": torch.from_numpy(self.ids), "weight": self.weight, "last": torch.from_numpy(self.last),
                "freq": torch.from_numpy(self.freq), "optimizer": self.optimizer.state_dict(), "clock": self.clock,
                "counters": dict(self.counters)}

    def load_state(self, state: dict[str, Any], done: Any = None) -> None:
        """Rows from a state written by any number of parts (each row kept only if it lives here;
        slots marked free, id -1, skipped); ``done(tensor)`` for each of the state's, once read
        (``TablePart.load_state``)."""
        ids = state["ids"].to(torch.int64)
        mine = ((ids >= 0) & (home_part(ids, self.num_parts) == self.part) if len(ids)
                else torch.zeros(0, dtype=torch.bool))
        ids = ids[mine]
        if len(ids) > self.cap:
            raise ValueError(f"table {self.name} part {self.part}: the state holds {len(ids)} rows for this part, "
                             f"more than its cap of {self.cap} (max_rows lowered?)")
        self.index = IdMap(2 * len(ids))
        self.clock = int(state.get("clock", 0))
        self.counters = {"admitted": 0, "evicted": 0, "rejected": 0, **dict(state.get("counters") or {})}
        self._alloc(max(min(self.cap, 1 << 12), len(ids)))
        n = len(ids)
        slots = np.arange(n, dtype=np.int64)
        self.free = list(range(len(self.ids) - 1, n - 1, -1))
        self.index.put(ids.numpy(), slots)
        self.ids[:n] = ids.numpy()
        self.weight[:n] = state["weight"][mine].to(self.weight.dtype)
        self.last[:n] = state["last"][mine].numpy()
        self.freq[:n] = state["freq"][mine].numpy()
        opt = dict(state.get("optimizer") or {})
        rows = {k: v[mine] for k, v in opt.items() if isinstance(v, torch.Tensor)}
        scalars = {k: v for k, v in opt.items() if not isinstance(v, torch.Tensor)}
        self.optimizer.load_state_dict(_pad_rows({**scalars, **rows}, n, self.optimizer.tensors()))
        self._pending = []
        self.evicted = []
        if done is not None:
            for t in (state["weight"], *(v for v in opt.values() if isinstance(v, torch.Tensor))):
                done(t)

    @property
    def nbytes(self) -> int:
        state = self.optimizer.state_dict()
        return (self.weight.numel() * self.weight.element_size() + self.ids.nbytes + self.last.nbytes
                + self.freq.nbytes + self.index.keys.nbytes + self.index.vals.nbytes
                + sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
                + (self.sketch.counts.nbytes if self.sketch is not None else 0))


def _pad_rows(state: dict[str, Any], rows: int, like: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state``'s per-row tensors (their first ``rows``) over ``like`` (a fresh optimizer's, as long
    as the new capacity): the rest keep their initial values."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and key in like:
            full = like[key].clone()
            full[:rows] = value[:rows]
            out[key] = full
        else:
            out[key] = value
    return out
