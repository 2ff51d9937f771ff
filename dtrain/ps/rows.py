"""One ps task's rows of a sparse embedding table, stored compactly, and their optimizer.

``TablePart`` holds this task's rows of one table (TensorFlow's ``mod`` or ``div``
partition_strategy) as a (rows, dim) tensor in the table's *storage* dtype (``float32``,
``bfloat16`` or ``float16``), initialised here from the run's seed with the table's chunked
initialisation (``dtrain.model.tables.init_rows``: the same values whatever the number of ps
tasks; drawn in float32 one chunk at a time and stored rounded to nearest, so the part never
exists in float32 as a whole). Replicas push (global ids, summed row gradients) and gather rows
by global id; ids are checked, so a bad id is refused before anything is read or written.

Gradients arrive, and the optimizer runs, in float32: a step gathers its touched rows to float32,
updates them (``dtrain.ps.row_optimizers``) and writes them back. A bfloat16 or float16 write-back
rounds **stochastically** (as FBGEMM's embedding tables do): a value between two representable
neighbours becomes the upper one with probability equal to its distance from the lower one, in
units of the gap, so the stored value is right on average and updates far smaller than half a
gap still move the row over many steps (round-to-nearest would drop every one of them):

- bfloat16: uniform random bits are added to the low 16 bits of the float32 pattern, which are
  then cut off (exact: bfloat16 is float32's upper half);
- float16: the same with the low 13 bits where the result is a normal float16 (|x| >= 2**-14);
  below that, among float16's subnormals, whose gap is 2**-24 everywhere,
  ``floor(x * 2**24 + u) * 2**-24`` with u uniform in [0, 1). Beyond float16's largest value
  (65504) a row overflows to inf, as a float16 cast does.

The random bits of a step come from a generator seeded by (run seed, table name, part, step): a
run is reproducible for a fixed number of ps tasks, and a resumed run draws what it would have.
``gather`` returns float32 rows (the wire and the replicas stay float32).

Pure torch: no Dask.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from dtrain.model.ids import id_rows
from dtrain.model.tables import CHUNK_ROWS, global_rows, init_rows

from .row_optimizers import ROW_OPTIMIZERS, ROW_STATE, RowOptimizer, make_row_optimizer, row_state_bytes

__all__ = ["ROW_OPTIMIZERS", "ROW_STATE", "STORAGE", "ChangeMarks", "TablePart", "make_row_optimizer", "pack_state",
           "round_stochastic", "row_state_bytes", "unique_rows", "unpack_state"]

STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""A table's storage dtypes, by the name a ``Table`` and the plan give them."""

_FP16_MIN_NORMAL = 2.0 ** -14
_FP16_SUBNORMAL_GAP = 2.0 ** -24


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """float32 ``x`` in ``dtype`` (bfloat16 or float16), rounded stochastically (module docstring);
    ``x`` is overwritten. NaN stays NaN."""
    if dtype == torch.float32:
        return x
    x = x.contiguous()  # (the bit view below needs it)
    nan = torch.isnan(x)
    low = 16 if dtype == torch.bfloat16 else 13
    sub = x.abs() < _FP16_MIN_NORMAL if dtype == torch.float16 else None
    tiny = None
    if sub is not None and bool(sub.any()):  # float16 subnormals: a fixed gap of 2**-24
        small = x[sub]
        u = torch.rand(small.shape, generator=generator, dtype=torch.float32)
        tiny = small.mul_(1 / _FP16_SUBNORMAL_GAP).add_(u).floor_().mul_(_FP16_SUBNORMAL_GAP)
    bits = x.view(torch.int32)  # sign and magnitude: adding to the pattern grows |x|, cutting shrinks it
    bits.add_(torch.randint(0, 1 << low, x.shape, generator=generator, dtype=torch.int32))
    bits.bitwise_and_(-(1 << low))
    if tiny is not None:
        x[sub] = tiny
    if bool(nan.any()):
        x[nan] = float("nan")
    return x.to(dtype)


def pack_state(state: dict[str, Any]) -> dict[str, Any]:
    """A part state (or chunk) ready for Dask: bfloat16 rows travel as their int16 bit patterns
    (Dask serialises tensors through numpy, which has no bfloat16). :func:`unpack_state` undoes it."""
    weight = state.get("weight")
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
        return {**state, "weight": weight.view(torch.int16), "weight_bits": "bfloat16"}
    return state


def unpack_state(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`pack_state`'s input back (a state that was not packed is returned as it is)."""
    if state.get("weight_bits") != "bfloat16":
        return state
    out = {k: v for k, v in state.items() if k != "weight_bits"}
    out["weight"] = state["weight"].view(torch.bfloat16)
    return out


class ChangeMarks:
    """Which rows were written since the last checkpoint's snapshot, in two masks: :meth:`flip`
    (under the snapshot's hold, once the writer has its copy-on-write view) makes the clean one
    current at no cost, and :meth:`clear_spare` clears the other afterwards, off the hold (zeroing
    a mask of 10**8 rows takes a tenth of a second, most of it copying the pages the writer
    shares)."""

    def __init__(self, rows: int):
        self.current = torch.zeros(rows, dtype=torch.bool)
        self.spare = torch.zeros(rows, dtype=torch.bool)

    def flip(self) -> None:
        self.current, self.spare = self.spare, self.current

    def clear_spare(self) -> None:
        self.spare.zero_()


def unique_rows(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(local, return_inverse=True)``, through a stable sort: a step's rows come as a
    few sorted runs (each push's ids are sorted), which a stable (merge) sort takes in one pass,
    several times faster than ``unique``'s sort."""
    ordered, order = torch.sort(local, stable=True)
    rows, inverse = torch.unique_consecutive(ordered, return_inverse=True)
    return rows, torch.empty_like(inverse).index_copy_(0, order, inverse)


def sum_rows(pending: list[tuple[torch.Tensor, torch.Tensor]], dim: int, scale: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's pushed (rows, gradients) pairs -> (its unique rows, sorted, and each row's gradients
    summed in the order they came, times ``scale``)."""
    local = torch.cat([i for i, _ in pending]) if len(pending) > 1 else pending[0][0]
    grads = torch.cat([g for _, g in pending]) if len(pending) > 1 else pending[0][1]
    rows, inverse = unique_rows(local)
    summed = torch.zeros((len(rows), dim), dtype=torch.float32).index_add_(0, inverse, grads)
    if scale != 1.0:
        summed.mul_(scale)
    return rows, summed


def _stream_seed(seed: int, name: str, part: int, step: int) -> int:
    """The rounding generator's seed for one step of one part (stable across processes)."""
    return (int(seed) * 1_000_033 + zlib.crc32(name.encode()) * 7_919 + int(part) * 104_729
            + int(step) * 15_485_863 + 0x5EED) % (2**63 - 1)


class TablePart:
    """This ps task's rows of one table (in its storage dtype), their optimizer and the step's
    gradient accumulator."""

    def __init__(self, name: str, num_embeddings: int, dim: int, num_parts: int, part: int, strategy: str,
                 init_std: float, seed: int, optimizer_config: dict[str, Any], storage: str = "float32",
                 init: str = "chunked", buffers: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None,
                 fresh: torch.Tensor | None = None, track: bool = False,
                 marks: tuple[ChangeMarks, int] | None = None):
        """``buffers``: where the part keeps its rows and optimizer state instead of tensors of its
        own (views into a :class:`~dtrain.ps.groups.TableGroup`'s, already holding the optimizer's
        initial state); the rows are initialised there. ``track``: mark the rows that change, for
        incremental checkpoints (:meth:`delta_state`), in marks of its own or, ``marks``, in a
        group's (its :class:`ChangeMarks` and where this part's rows start in it)."""
        if storage not in STORAGE:
            raise ValueError(f"table {name}: storage {storage!r} is not one of {', '.join(map(repr, STORAGE))}")
        self.name, self.num_embeddings, self.dim = name, int(num_embeddings), int(dim)
        self.num_parts, self.part, self.strategy = int(num_parts), int(part), strategy
        self.storage, self.seed = storage, int(seed)
        self.rows = global_rows(self.num_embeddings, self.num_parts, self.part, strategy)
        shape = (len(self.rows), self.dim)
        self.weight = torch.empty(shape, dtype=STORAGE[storage]) if buffers is None else buffers[0]
        if tuple(self.weight.shape) != shape or self.weight.dtype != STORAGE[storage]:
            raise ValueError(f"table {name}: a buffer of {tuple(self.weight.shape)} {self.weight.dtype} for rows of "
                             f"{shape} {STORAGE[storage]}")
        # per_id: row i starts at id_rows(i) (dtrain.model.ids), drawn the first time the row is read
        # or updated (``fresh`` marks the rows not drawn yet; a group passes a view of its own): a
        # table of 10**8 rows starts at once, and its untouched rows take no memory (the storage is
        # allocated, its pages are not written).
        self.init_std = float(init_std)
        self._fresh: torch.Tensor | None = None
        if init == "per_id":
            self._fresh = torch.ones(len(self.rows), dtype=torch.bool) if fresh is None else fresh
        else:
            self._init(init_std, init)
        self.optimizer: RowOptimizer = make_row_optimizer(0 if buffers else len(self.rows), self.dim, optimizer_config)
        if buffers is not None:
            self.optimizer.share(buffers[1])
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._generator = torch.Generator()  # the stochastic rounding's bits, reseeded every step
        # The rows written since the last checkpoint's snapshot (updated, or drawn on first use).
        self.marks, self._mark_at = marks if marks is not None else (
            (ChangeMarks(len(self.rows)), 0) if track else (None, 0))
        self.owns_marks = marks is None and track

    def _init(self, std: float, init: str) -> None:
        if self.weight.dtype == torch.float32:
            init_rows(self.seed, self.name, self.num_embeddings, self.dim, std, self.rows, out=self.weight, init=init)
            return
        # One float32 slice per initialisation chunk that holds rows of this part (each chunk drawn
        # once, as init_rows draws it), stored rounded to nearest: never the whole part in float32.
        r = self.rows
        if not len(r):
            return
        for c in range(r.start // CHUNK_ROWS, r[-1] // CHUNK_ROWS + 1):
            k0 = max(0, -(-(c * CHUNK_ROWS - r.start) // r.step))
            k1 = min(len(r), -(-((c + 1) * CHUNK_ROWS - r.start) // r.step))
            if k1 > k0:  # (a range ending one past its last id: init_rows reads ``stop - 1`` as the last)
                ids = range(r[k0], r[k1 - 1] + 1, r.step)
                self.weight[k0:k1].copy_(init_rows(self.seed, self.name, self.num_embeddings, self.dim, std, ids,
                                                   init=init))

    def check_ids(self, ids: torch.Tensor | None) -> str | None:
        """Why ``ids`` cannot be served here (an id outside the table or on another task), or None."""
        if ids is None or not len(ids):
            return None
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if self.strategy == "mod":
            bad |= ids % self.num_parts != self.part
        else:
            bad |= (ids < self.rows.start) | (ids >= self.rows.stop)
        if bool(bad.any()):
            first = int(ids[torch.nonzero(bad)[0, 0]])
            where = "outside" if not 0 <= first < self.num_embeddings else f"not on ps part {self.part} of"
            return (f"id {first} is {where} table {self.name} (num_embeddings {self.num_embeddings}, ids 0.."
                    f"{self.num_embeddings - 1})")
        return None

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64)
        return ids // self.num_parts if self.strategy == "mod" else ids - self.rows.start

    def ensure(self, local: torch.Tensor) -> None:
        """Draw the initial values of the ``local`` rows not drawn yet (per_id: see ``__init__``)."""
        if self._fresh is None or not local.numel():
            return
        need = local[self._fresh.index_select(0, local)]
        if need.numel():
            need = torch.unique(need)
            ids = need * self.num_parts + self.part if self.strategy == "mod" else need + self.rows.start
            self.weight[need] = id_rows(self.seed, self.name, ids, self.dim, self.init_std).to(self.weight.dtype)
            self._fresh[need] = False
            if self._changed is not None:
                self._changed[need] = True

    def draw_all(self) -> None:
        """Draw every row not drawn yet, at once (per_id: the values :meth:`ensure` would draw),
        without the change marks (a part that starts drawn)."""
        if self._fresh is None or not len(self.rows):
            return
        local = torch.arange(len(self.rows))
        ids = local * self.num_parts + self.part if self.strategy == "mod" else local + self.rows.start
        rows = id_rows(self.seed, self.name, ids, self.dim, self.init_std)
        if bool(self._fresh.all()):
            self.weight.copy_(rows)
        else:
            self.weight[self._fresh] = rows[self._fresh].to(self.weight.dtype)
        self._fresh.fill_(False)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of global ``ids`` (checked by the caller with :meth:`check_ids`), a copy."""
        local = self._local(ids)
        self.ensure(local)
        return self.weight.index_select(0, local).to(torch.float32)

    lookup = gather  # (no side effect: the same for a replica's step and an evaluation)

    def stats(self) -> dict[str, int]:
        return {"live_rows": len(self.rows), "bytes": self.nbytes}

    def add_grad(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One replica's sparse gradient for this step (applied, summed per id, by :meth:`apply`)."""
        self._pending.append((self._local(ids), grads.to(torch.float32)))

    def clear(self) -> None:
        self._pending = []

    def apply(self, scale: float = 1.0) -> None:
        """One optimizer step with the step's gradients summed per id and multiplied by ``scale``:
        the touched rows gathered to float32, updated, written back (module docstring)."""
        if not self._pending:
            self.optimizer.step(torch.empty((0, self.dim)), torch.empty(0, dtype=torch.int64), torch.empty((0, self.dim)))
            return
        rows, summed = sum_rows(self._pending, self.dim, scale)
        self._pending = []
        self.ensure(rows)
        w = self.weight.index_select(0, rows).to(torch.float32)
        self.optimizer.step(w, rows, summed)
        if self.weight.dtype != torch.float32:
            self._generator.manual_seed(_stream_seed(self.seed, self.name, self.part, self.optimizer.step_count))
            w = round_stochastic(w, self.weight.dtype, self._generator)
        self.weight.index_copy_(0, rows, w)
        if self._changed is not None:
            self._changed[rows] = True

    def state(self, copy: bool = False) -> dict[str, Any]:
        """Rows (in the storage dtype) and optimizer state (``copy``: cloned, else the live tensors)."""
        if copy:
            return self.chunk(0, len(self.rows))
        return {"weight": self.weight, "optimizer": self.optimizer.state_dict()}

    def live_state(self) -> dict[str, Any]:
        """The live rows (in the storage dtype), optimizer state and, for rows initialised on first
        use, which rows are not drawn yet (``fresh``: their stored values are meaningless): no copy,
        no row drawn (a checkpoint's part, written from a copy-on-write snapshot)."""
        out = {"weight": self.weight, "optimizer": self.optimizer.state_dict()}
        if self._fresh is not None:
            out["fresh"] = self._fresh
        return out

    def delta_state(self) -> dict[str, Any]:
        """The rows written since :meth:`mark_clean` (local indices, sorted), their values and
        optimizer state, copied; the step count whole (an incremental checkpoint's part: called in
        its copy-on-write writer, which sees the rows as they were at the snapshot)."""
        if self._changed is None:
            raise ValueError(f"table {self.name}: changes are not tracked (checkpoint.incremental is not set)")
        rows = torch.nonzero(self._changed).flatten()
        per_row = self.optimizer.tensors()
        opt = {k: per_row[k].index_select(0, rows) if k in per_row else v
               for k, v in self.optimizer.state_dict().items()}
        return {"delta": True, "rows": rows, "weight": self.weight.index_select(0, rows), "optimizer": opt}

    @property
    def _changed(self) -> torch.Tensor | None:
        """This part's current change marks (a view), None when changes are not tracked."""
        if self.marks is None:
            return None
        return self.marks.current[self._mark_at:self._mark_at + len(self.rows)]

    def snapshot_taken(self) -> None:
        """A checkpoint's snapshot was taken (the writer holds the marks as they were): the next
        delta holds the rows written after it (a group's member: its group flips the marks)."""
        if self.owns_marks and self.marks is not None:
            self.marks.flip()

    def mark_clean(self) -> None:
        """No row counts as changed (the part was just restored)."""
        if self.marks is not None:
            lo, hi = self._mark_at, self._mark_at + len(self.rows)
            self.marks.current[lo:hi] = False
            self.marks.spare[lo:hi] = False

    def load_delta(self, state: dict[str, Any]) -> None:
        """Apply :meth:`delta_state`'s output over the rows restored from the checkpoint it follows."""
        rows = state["rows"].to(torch.int64)
        if len(rows) and (int(rows.max()) >= len(self.rows) or int(rows.min()) < 0):
            raise ValueError(f"table {self.name} part {self.part}: a delta names local row {int(rows.max())}, this "
                             f"part holds {len(self.rows)} (another ps count or partition?)")
        self.weight.index_copy_(0, rows, state["weight"].to(self.weight.dtype))
        per_row = self.optimizer.tensors()
        opt = dict(state.get("optimizer") or {})
        for key, value in opt.items():
            if key in per_row and isinstance(value, torch.Tensor):
                per_row[key].index_copy_(0, rows, value.to(per_row[key].dtype))
        self.optimizer.step_count = int(opt.get("step", self.optimizer.step_count))
        if self._fresh is not None:
            self._fresh[rows] = False
        self._pending = []

    def chunk(self, start: int, stop: int) -> dict[str, Any]:
        """Rows ``[start, stop)`` (local) and their optimizer state, copied; the step count whole."""
        state = self.optimizer.state_dict()
        self.ensure(torch.arange(start, min(stop, len(self.rows))))  # (a checkpoint holds every row's value)
        return {"weight": self.weight[start:stop].clone(),
                "optimizer": {k: v[start:stop].clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}}

    def load_state(self, state: dict[str, Any], done: Any = None) -> None:
        """Restore :meth:`state`'s output. Rows of another storage dtype are converted (rounded to
        nearest); optimizer state of another row optimizer is refused. The rows are copied a block
        at a time, and ``done(block)`` called with each block of the state once copied (a restore
        from a memory-mapped part gives its pages back: ``dtrain.ps.part_writer.drop_pages``)."""
        where = f"table {self.name} part {self.part}"
        if tuple(state["weight"].shape) != tuple(self.weight.shape):
            raise ValueError(f"{where}: a state of shape {tuple(state['weight'].shape)}, "
                             f"this part holds {tuple(self.weight.shape)} (another ps count or partition?)")
        opt = dict(state.get("optimizer") or {})
        theirs = sorted(k for k, v in opt.items() if isinstance(v, torch.Tensor))
        mine = sorted(self.optimizer.tensors())
        if theirs and theirs != mine:
            raise ValueError(f"{where}: the state holds optimizer state {theirs}, the table's {self.optimizer.name} "
                             f"keeps {mine or 'none'} (written with another row optimizer)")
        try:
            self.optimizer.load_state_dict(opt)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        fresh, weight = state.get("fresh"), state["weight"]
        keep = self._fresh is not None and fresh is not None  # undrawn rows stay undrawn (and untouched: no memory)
        for lo in range(0, len(weight), CHUNK_ROWS):
            block = weight[lo:lo + CHUNK_ROWS]
            if keep:
                drawn = torch.nonzero(~fresh[lo:lo + CHUNK_ROWS]).flatten()
                self.weight[drawn + lo] = block[drawn].to(self.weight.dtype)
            else:
                self.weight[lo:lo + CHUNK_ROWS].copy_(block)
            if done is not None:
                done(block)
        if keep:
            self._fresh.copy_(fresh)
        if done is not None:
            for t in opt.values():
                if isinstance(t, torch.Tensor):
                    done(t)
        if self._fresh is not None and fresh is None:  # (every row's value came with the state)
            self._fresh.zero_()
        if self._fresh is None and fresh is not None and bool(fresh.any()):
            rows = torch.nonzero(fresh).flatten()
            ids = rows * self.num_parts + self.part if self.strategy == "mod" else rows + self.rows.start
            self.weight[rows] = id_rows(self.seed, self.name, ids, self.dim, self.init_std).to(self.weight.dtype)
        self._pending = []
        self.mark_clean()

    @property
    def nbytes(self) -> int:
        """Bytes of the rows and their optimizer state (each tensor's own element size)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, *self.optimizer.tensors().values()))
