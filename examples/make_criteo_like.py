"""Write seeded, learnable Criteo-layout click logs of any size (``.tsv.gz``, or ``.tsv``).

Every line is a Criteo example (docs/data.md, "Criteo-layout and multi-hot input"): a 0/1 label,
13 integer features ``I1..I13`` and 26 categorical features ``C1..C26``, tab-separated.

- Categorical feature ``Cf`` has ``round(F x`` Criteo 1TB's cardinality of ``Cf`` ``)`` distinct
  values, at least 2 (``--scale F``; the cardinalities are
  ``dtrain.data.criteo.CRITEO_1TB_CARDINALITIES``, so ``--scale 1`` gives 1TB's table sizes).
  Values are Zipf-distributed (``--zipf-a``: a few hot values, a long tail) and written as
  8 hex digits through a seeded 32-bit bijection, so they look like Criteo's (``68fd1e64``) and
  distinct values stay distinct. About 3% of categorical fields are empty.
- The first ``--multi-hot N`` categorical features are multi-hot: 1 to ``--max-ids M`` values
  each, comma-separated (``68fd1e64,2c16a946``).
- Integer features are counts (log-normal, some shifted so that they go negative, as Criteo's
  ``I2`` does); about 5% of them are empty.
- Labels: every (feature, value) has a hidden normal weight, every integer feature a hidden
  linear weight on ``log(1 + max(x, 0))``; an example's logit is the sum of its values' weights
  (a multi-hot list counts its mean) plus the linear term, scaled to unit variance, plus normal
  noise (``--noise``); the label is 1 where the logit is above a threshold chosen so that about
  25% are positive (Criteo's click-through rate is about that). A model that learns the hot
  values' weights beats always predicting 0.

Flags: ``--out DIR`` (created), ``--rows N`` (in all), ``--files K`` (``part-00000.tsv.gz``...,
rows split evenly), ``--seed S``, ``--scale F`` (default 0.001), ``--multi-hot N`` (default 0),
``--max-ids M`` (default 4), ``--no-gzip`` (plain ``.tsv``), ``--zipf-a A`` (default 1.2),
``--noise SIGMA`` (default 0.5).

    python examples/make_criteo_like.py --out data/criteo --rows 1000000 --files 8 --seed 0
    python examples/make_criteo_like.py --out data/mh --rows 100000 --multi-hot 3 --max-ids 5

The same arguments write the same bytes (one generator per file and chunk). Importable:
``generate(out, rows, ...)`` returns the files written.
"""

from __future__ import annotations

import argparse
import math
import sys
from gzip import GzipFile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

try:
    from dtrain.data.criteo import CRITEO_1TB_CARDINALITIES, CRITEO_CATEGORICAL, CRITEO_DENSE
except ImportError:  # run from a checkout without installing: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dtrain.data.criteo import CRITEO_1TB_CARDINALITIES, CRITEO_CATEGORICAL, CRITEO_DENSE

CHUNK = 1 << 18  # rows generated and written at a time (bounded memory for any file size)
POSITIVE = 0.25  # share of positive labels
MISSING_DENSE, MISSING_CAT = 0.05, 0.03
_M32 = np.uint64(0xFFFFFFFF)
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_HEX2 = (_HEX[np.arange(256) >> 4].astype(np.uint16) | (_HEX[np.arange(256) & 15].astype(np.uint16) << 8))
# _HEX2[b]: byte b's two hex digits as a little-endian uint16 (the first digit in the low byte)


def cardinalities(scale: float) -> list[int]:
    """Each categorical feature's number of distinct values at ``scale``."""
    return [max(2, round(c * scale)) for c in CRITEO_1TB_CARDINALITIES]


def _mix32(x: np.ndarray, salt: int) -> np.ndarray:
    """A bijection of 32-bit values (odd multiplications and xor-shifts mod 2**32), keyed by ``salt``."""
    x = (x.astype(np.uint64) + np.uint64(salt)) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


def _zipf(rng: np.random.Generator, a: float, card: int, n: int) -> np.ndarray:
    """``n`` ranks in ``[0, card)``, 0 the hottest: a power law of exponent ``a`` truncated to ``card``
    values, by inverting its continuous CDF (numpy's unbounded ``zipf`` is ten times slower)."""
    u = rng.random(n)
    if abs(a - 1.0) < 1e-9:
        x = np.power(float(card + 1), u)
    else:
        x = np.power(1.0 - u * (1.0 - float(card + 1) ** (1.0 - a)), 1.0 / (1.0 - a))
    return np.minimum(x.astype(np.int64) - 1, card - 1)


def _hex_lists(codes: np.ndarray, lengths: np.ndarray, empty: np.ndarray) -> pa.StringArray:
    """Fields of comma-separated 8-hex-digit codes (``lengths`` per field; ``empty`` fields hold
    none), built as one string array's buffers (pyarrow from numpy strings is 50x slower)."""
    keep = np.repeat(~empty, lengths) if len(codes) != len(lengths) else ~empty
    lengths = np.where(empty, 0, lengths)
    digits = _HEX2[codes[keep].astype(">u4").view(np.uint8).reshape(-1, 4)].view(np.uint8)  # (k, 8) ascii
    if len(codes) == len(empty):  # single values: no commas
        offsets = np.concatenate([[0], np.cumsum(8 * lengths)]).astype(np.int32)
        return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(digits))
    text = np.empty((len(digits), 9), dtype=np.uint8)
    text[:, :8] = digits
    text[:, 8] = ord(",")
    last = np.cumsum(lengths)[lengths > 0] - 1  # no comma after a field's last code
    mask = np.ones(text.shape, dtype=bool)
    mask[last, 8] = False
    data = text[mask]
    offsets = np.concatenate([[0], np.cumsum(np.where(lengths > 0, 9 * lengths - 1, 0))]).astype(np.int32)
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data))


def _hidden_weight(values: np.ndarray, salt: int) -> np.ndarray:
    """A normal(0, 1) weight per value, computed from the value and ``salt`` (Box-Muller on two
    hashed uniforms): 1TB's 40M values need no stored table."""
    u1 = (_mix32(values, salt).astype(np.float64) + 0.5) / 2**32
    u2 = (_mix32(values, salt ^ 0x5BD1E995).astype(np.float64) + 0.5) / 2**32
    return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


class _Model:
    """The hidden parameters, from the seed: per-feature salts, the dense weights and shapes."""

    def __init__(self, seed: int, scale: float, multi_hot: int, max_ids: int, zipf_a: float, noise: float):
        rng = np.random.default_rng([seed, 0])
        self.cards = cardinalities(scale)
        # Per feature: the ranking's stride and offset, the hex code's key, the hidden weights' key.
        self.salts = rng.integers(1, 2**31, (len(self.cards), 4)).tolist()
        self.stride = []  # the ranking rank -> (stride * rank + offset) % card: a bijection (gcd 1)
        for f, card in enumerate(self.cards):
            a = 2 * self.salts[f][0] + 1
            while math.gcd(a, card) != 1:
                a += 2
            self.stride.append(a % card or 1)
        self.multi_hot, self.max_ids, self.zipf_a, self.noise = multi_hot, max_ids, zipf_a, noise
        self.tables = [_hidden_weight(np.arange(card), self.salts[f][3]) if card <= 1 << 22 else None
                       for f, card in enumerate(self.cards)]  # the same weights, looked up (faster)
        self.dense_w = rng.standard_normal(len(CRITEO_DENSE))
        self.mu = rng.uniform(0.0, 4.0, len(CRITEO_DENSE))
        self.sigma = rng.uniform(0.5, 1.5, len(CRITEO_DENSE))
        self.shift = np.where(np.arange(len(CRITEO_DENSE)) % 6 == 1, 3, 0)  # I2, I8: may go negative
        pilot = [self._count(np.random.default_rng([seed, 1, j]), j, 100_000) for j in range(len(CRITEO_DENSE))]
        self.t_mean = [float(np.log1p(np.maximum(v, 0)).mean()) for v in pilot]  # to standardise the linear term
        self.t_std = [float(np.log1p(np.maximum(v, 0)).std()) + 1e-9 for v in pilot]
        self.threshold = 0.0  # then from a pilot sample of logits (the same for every file)
        self.threshold = float(np.quantile(self.rows(np.random.default_rng([seed, 1]), 100_000)[2], 1 - POSITIVE))

    def _count(self, rng: np.random.Generator, j: int, n: int) -> np.ndarray:
        """``n`` values of integer feature ``j``: log-normal counts, shifted below 0 for some features."""
        return np.floor(np.exp(rng.normal(self.mu[j], self.sigma[j], n))) - self.shift[j]

    def rows(self, rng: np.random.Generator, n: int) -> tuple[list[np.ndarray], list[tuple], np.ndarray]:
        """(dense columns (float64, NaN = empty), categorical (values, lengths, empty mask), logits)."""
        dense = []
        logit = np.zeros(n)
        for j in range(len(CRITEO_DENSE)):
            v = self._count(rng, j, n)
            logit += self.dense_w[j] * (np.log1p(np.maximum(v, 0)) - self.t_mean[j]) / self.t_std[j]
            v[rng.random(n) < MISSING_DENSE] = np.nan
            dense.append(v)
        cats = []
        for f, card in enumerate(self.cards):
            multi = f < self.multi_hot
            lengths = rng.integers(1, self.max_ids + 1, n) if multi else np.ones(n, np.int64)
            total = int(lengths.sum())
            rank = _zipf(rng, self.zipf_a, card, total)
            value = (rank * self.stride[f] + self.salts[f][1]) % card  # a seeded ranking
            w = self.tables[f][value] if self.tables[f] is not None else _hidden_weight(value, self.salts[f][3])
            sums = np.add.reduceat(w, np.cumsum(lengths) - lengths) / lengths
            empty = rng.random(n) < MISSING_CAT
            logit += np.where(empty, 0.0, sums)
            cats.append((value, lengths, empty))
        logit = logit / np.sqrt(len(self.cards) + len(CRITEO_DENSE)) + self.noise * rng.standard_normal(n)
        return dense, cats, logit - self.threshold

    def table(self, rng: np.random.Generator, n: int) -> pa.Table:
        """``n`` lines as a pyarrow table of the 40 Criteo columns (nulls are empty fields)."""
        dense, cats, logit = self.rows(rng, n)
        columns = {"label": pa.array((logit > 0).astype(np.int8))}
        for name, v in zip(CRITEO_DENSE, dense, strict=True):
            columns[name] = pa.array(np.nan_to_num(v).astype(np.int64), mask=np.isnan(v))
        for f, (name, (value, lengths, empty)) in enumerate(zip(CRITEO_CATEGORICAL, cats, strict=True)):
            columns[name] = _hex_lists(_mix32(value, self.salts[f][2]), lengths, empty)
        return pa.table(columns)


def generate(out: str | Path, rows: int, files: int = 1, seed: int = 0, scale: float = 0.001, multi_hot: int = 0,
             max_ids: int = 4, gzip: bool = True, zipf_a: float = 1.2, noise: float = 0.5) -> list[Path]:
    """Write ``rows`` Criteo-layout lines in ``files`` files under ``out``; returns their paths."""
    if rows < 1 or files < 1 or not 0 <= multi_hot <= len(CRITEO_CATEGORICAL) or max_ids < 1 or scale <= 0:
        raise ValueError("generate needs rows >= 1, files >= 1, 0 <= multi_hot <= 26, max_ids >= 1 and scale > 0")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = _Model(seed, scale, multi_hot, max_ids, zipf_a, noise)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    paths = []
    for i in range(files):
        n = rows // files + (1 if i < rows % files else 0)
        path = out / f"part-{i:05d}.tsv{'.gz' if gzip else ''}"
        with open(path, "wb") as raw, (GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=1, mtime=0)
                                       if gzip else raw) as sink:  # level 1: 4x faster than 6, 30% larger
            for c, start in enumerate(range(0, n, CHUNK)):
                table = model.table(np.random.default_rng([seed, 2, i, c]), min(CHUNK, n - start))
                buf = pa.BufferOutputStream()
                pacsv.write_csv(table, buf, options)
                sink.write(memoryview(buf.getvalue()))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python examples/make_criteo_like.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the directory to write into")
    p.add_argument("--rows", type=int, required=True, help="lines in all")
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=0.001, help="times Criteo 1TB's cardinalities (at least 2)")
    p.add_argument("--multi-hot", type=int, default=0, help="the first N categorical features are multi-hot")
    p.add_argument("--max-ids", type=int, default=4, help="values per multi-hot feature: 1..M")
    p.add_argument("--no-gzip", action="store_true", help="write plain .tsv")
    p.add_argument("--zipf-a", type=float, default=1.2)
    p.add_argument("--noise", type=float, default=0.5)
    a = p.parse_args(argv)
    paths = generate(a.out, a.rows, a.files, a.seed, a.scale, a.multi_hot, a.max_ids, not a.no_gzip, a.zipf_a,
                     a.noise)
    print(f"{a.out}: {a.rows} lines in {len(paths)} file(s); cardinalities {cardinalities(a.scale)}")


if __name__ == "__main__":
    main()
