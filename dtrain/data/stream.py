"""A replica's stream of batches from its shards: reader threads, a shuffle window, prefetch.

TensorFlow fed workers with reader threads, a ``RandomShuffleQueue`` (``min_after_dequeue``) and an
``OutOfRange`` error at the end of the epochs; this is the same with exact, resumable positions (the
end raises :class:`dtrain.OutOfRange`, the error a hook raises to stop training):

- every epoch the replica's shards are read in a seeded order (``[seed, replica, epoch]``), by
  ``readers`` background threads that read ahead of the one being consumed;
- the epoch's samples, in that order, are cut into windows of ``window`` samples
  (``data.shuffle_buffer``); each window is permuted (seeded by the epoch and window) and cut into
  batches of ``batch_size`` (a batch may span two windows); an epoch's last partial batch is
  dropped, so an epoch is ``rows // batch_size`` batches;
- ``prefetch`` batches wait ready in a bounded queue.

Memory is bounded by the window, the shards being read and the queue, never by the dataset. The
order depends only on (seed, replica, shards, batch size, window): batch ``k`` is the same whatever
the threads' timing, so a position is one integer (batches taken), and :meth:`StreamLayout.locate`
turns it into (epoch, shard, offset). Resuming at batch ``k`` re-reads only the window that batch
starts in. A shard that cannot be read fails the stream naming the file (:class:`BadShardError`), or
with ``skip_bad`` its samples are left out of their batches (a batch wholly in a bad shard is empty
and skipped: the position still counts it).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtrain.errors import OutOfRange  # the replica has read its shards ``epochs`` times

from .shards import BadShardError, Shard

logger = logging.getLogger(__name__)


def shard_order(n: int, seed: int, replica: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order the replica reads its ``n`` shards in ``epoch``."""
    return np.random.default_rng([seed, replica, epoch, 1]).permutation(n) if shuffle else np.arange(n)


def window_permutation(n: int, seed: int, replica: int, epoch: int, window: int, shuffle: bool = True) -> np.ndarray:
    """The order of the ``n`` samples of window ``window`` of ``epoch``."""
    return np.random.default_rng([seed, replica, epoch, 2, window]).permutation(n) if shuffle else np.arange(n)


@dataclass(frozen=True)
class StreamLayout:
    """Where batch ``k`` of a replica's stream comes from (pure arithmetic, no reading)."""

    rows: tuple[int, ...]  # rows of the replica's shards, in assignment order
    batch_size: int
    window: int
    seed: int
    replica: int
    shuffle: bool = True
    epochs: int | None = None

    @property
    def samples(self) -> int:
        return sum(self.rows)

    @property
    def batches_per_epoch(self) -> int:
        return self.samples // self.batch_size

    @property
    def total_batches(self) -> int | None:
        return None if self.epochs is None else self.epochs * self.batches_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        return shard_order(len(self.rows), self.seed, self.replica, epoch, self.shuffle)

    def locate(self, batch: int) -> dict[str, int]:
        """Batch ``batch``'s position: its epoch, its index in the epoch, and the shard (index in
        the assignment) and row offset where reading resumes for it (the start of its window)."""
        epoch, j = divmod(int(batch), max(1, self.batches_per_epoch))
        start = (j * self.batch_size) // self.window * self.window
        order = self.order(epoch)
        cum = np.cumsum([0] + [self.rows[i] for i in order])
        k = min(int(np.searchsorted(cum, start, side="right")) - 1, len(order) - 1)
        return {"epoch": epoch, "batch": j, "shard": int(order[k]), "offset": int(start - cum[k])}

    def epochs_done(self, batch: int) -> float:
        """Epochs completed after ``batch`` batches (fractional)."""
        return batch / self.batches_per_epoch if self.batches_per_epoch else 0.0


@dataclass
class StreamCounters:
    batches: int = 0  # position: batches taken (skipped empty ones included)
    samples: int = 0
    bad_files: list[str] = field(default_factory=list)


_MALLOC_FIXED = False


def fix_mmap_threshold(nbytes: int = 4 << 20) -> None:
    """Keep glibc's mmap threshold at ``nbytes``. glibc raises it after every large free (up to
    32 MiB), so a process that reads shard after shard of tens of MB ends up carving them out of its
    heap, which fragments: its RSS creeps up with the size of the dataset. With a fixed threshold
    every large buffer goes back to the system when freed (measured: benchmarks/input_bench.py).
    Once per process; Linux with glibc only, else nothing."""
    global _MALLOC_FIXED
    if _MALLOC_FIXED or not sys.platform.startswith("linux"):
        return
    _MALLOC_FIXED = True
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (musl): no such knob
        pass


class ShardStream:
    """Batches of (x, y) numpy arrays from ``shards`` (see the module docstring). ``read`` gives a
    shard's raw (x, y); ``transform`` makes them training arrays (standardised float32 or int64 ids,
    encoded labels). Call :meth:`next` for each batch; :meth:`close` stops the threads."""

    def __init__(self, layout: StreamLayout, shards: Sequence[Shard], read: Callable[[Shard], tuple[Any, Any]],
                 transform: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], *,
                 readers: int = 2, prefetch: int = 4, skip_bad: bool = False, start: int = 0,
                 get_timeout_s: float = 3600.0):
        if len(shards) != len(layout.rows) or not shards:
            raise ValueError("a stream needs its shards and their rows")
        if layout.batches_per_epoch < 1:
            raise ValueError(f"the replica's {layout.samples} samples cannot fill one batch of {layout.batch_size}; "
                             "lower data.batch_size or give each replica more data")
        fix_mmap_threshold()
        self.layout, self.shards, self.read, self.transform = layout, list(shards), read, transform
        self.skip_bad = skip_bad
        self.counters = StreamCounters(batches=int(start))
        self.get_timeout_s = get_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="dtrain-reader")
        self._readers = readers
        self._thread = threading.Thread(target=self._produce, args=(int(start),), name="dtrain-stream", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- consumer
    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The next non-empty batch; OutOfRange at the end of the epochs; the reading error, if any."""
        while True:
            try:
                item = self._queue.get(timeout=self.get_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no batch from the readers in {self.get_timeout_s:.0f} s") from None
            if isinstance(item, BaseException):
                self._queue.put(item)  # every later call raises it too
                raise item
            position, x, y = item
            self.counters.batches = position
            if len(x):
                self.counters.samples += len(x)
                return x, y

    def close(self) -> None:
        self._stop.set()
        while True:  # free a producer blocked on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- producer
    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, batch: int) -> None:
        try:
            total = self.layout.total_batches
            while total is None or batch < total:
                batch = self._epoch(batch)
                if batch < 0:
                    return  # closed
            self._put(OutOfRange(f"read {self.layout.epochs} epoch(s)"))
        except BaseException as exc:  # handed to the consumer, who raises it
            self._put(exc)

    def _load(self, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        shard = self.shards[k]
        try:
            x, y = self.read(shard)
            return self.transform(x, y)
        except Exception as exc:
            err = exc if isinstance(exc, BadShardError) else BadShardError(f"{shard.name} ({shard.path}): {exc}")
            if not self.skip_bad:
                if err is exc:
                    raise  # (never `raise exc from exc`: a cause cycle hangs whoever walks the causes)
                raise err from exc
            logger.warning("skipping %s (data.skip_bad_files): %s", shard.name, err)
            self.counters.bad_files.append(shard.name)
            return None

    def _epoch(self, batch: int) -> int:
        """Produce the batches of ``batch``'s epoch from ``batch`` on; returns the next position
        (the next epoch's first batch), or -1 once closed."""
        lay = self.layout
        b, w_size = lay.batch_size, lay.window
        epoch, j = divmod(batch, lay.batches_per_epoch)
        end = (epoch + 1) * lay.batches_per_epoch
        order = lay.order(epoch)
        rows = [lay.rows[i] for i in order]
        cum = np.cumsum([0] + rows)
        n = int(cum[-1])
        start = j * b
        window = start // w_size
        skip = start - window * w_size
        futures: dict[int, Future] = {}
        loaded: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        carry: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        carried = 0

        def shard_at(pos: int) -> int:
            return int(np.searchsorted(cum, pos, side="right")) - 1

        while batch < end:
            lo, hi = window * w_size, min((window + 1) * w_size, n)
            first, last = shard_at(lo), shard_at(hi - 1)
            for k in range(first, min(last + 1 + self._readers, len(order))):  # read ahead
                if k not in futures and k not in loaded:
                    futures[k] = self._pool.submit(self._load, int(order[k]))
            xs: list[np.ndarray | None] = []
            ys: list[np.ndarray | None] = []
            valid: list[np.ndarray] = []
            for k in range(first, last + 1):
                if k not in loaded:
                    loaded[k] = futures.pop(k).result()
                a, z = max(lo, int(cum[k])) - int(cum[k]), min(hi, int(cum[k + 1])) - int(cum[k])
                part = loaded[k]
                if part is None:  # skipped: its positions stay, empty
                    xs.append(None)
                    ys.append(None)
                    valid.append(np.zeros(z - a, dtype=bool))
                else:
                    xs.append(part[0][a:z])
                    ys.append(part[1][a:z])
                    valid.append(np.ones(z - a, dtype=bool))
            for k in [k for k in loaded if k < last or (k == last and hi >= int(cum[k + 1]))]:
                del loaded[k]  # consumed: memory goes back
            template = next((p for p in xs if p is not None), None)
            if template is not None:
                ytemplate = next(p for p in ys if p is not None)
                fx = [p if p is not None else np.zeros((len(v), *template.shape[1:]), template.dtype)
                      for p, v in zip(xs, valid, strict=True)]
                fy = [p if p is not None else np.zeros((len(v), *ytemplate.shape[1:]), ytemplate.dtype)
                      for p, v in zip(ys, valid, strict=True)]
                perm = window_permutation(hi - lo, lay.seed, lay.replica, epoch, window, lay.shuffle)
                one = len(fx) == 1  # the window within one shard: gather from it directly (one copy)
                wx = (fx[0] if one else np.concatenate(fx))[perm]
                wy = (fy[0] if one else np.concatenate(fy))[perm]
                wv = (valid[0] if one else np.concatenate(valid))[perm]
            else:  # the whole window is in skipped shards
                wx = wy = None
                wv = np.zeros(hi - lo, dtype=bool)
            pos = skip
            skip = 0
            while pos < hi - lo and batch < end:
                take = min(b - carried, hi - lo - pos)
                if wx is not None:
                    carry.append((wx[pos:pos + take], wy[pos:pos + take], wv[pos:pos + take]))
                else:
                    carry.append((None, None, wv[pos:pos + take]))  # type: ignore[arg-type]
                carried += take
                pos += take
                if carried == b:
                    batch += 1
                    if not self._put((batch, *_batch(carry))):
                        return -1
                    carry, carried = [], 0
            window += 1
        return batch


def _batch(carry: list[tuple[Any, Any, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One batch from its pieces, the skipped samples left out: copies, so that a batch waiting in
    the queue never keeps a whole window alive."""
    if len(carry) == 1 and carry[0][0] is not None and carry[0][2].all():  # the usual case
        return np.array(carry[0][0], order="C"), np.array(carry[0][1], order="C")
    kept = [(x if v.all() else x[v], y if v.all() else y[v]) for x, y, v in carry if x is not None and v.any()]
    if not kept:
        return np.empty((0,)), np.empty((0,))
    x = np.ascontiguousarray(np.concatenate([k[0] for k in kept]))
    y = np.ascontiguousarray(np.concatenate([k[1] for k in kept]))
    return x, y
