#!/usr/bin/env python
"""The recommendation benchmark's peers: one DLRM, trained by TorchRec or by plain PyTorch.

Run by the peer environment's python (``make bench-rec-env``; the ``torch`` row also runs in
dtrain's own venv, which has torch but not torchrec)::

    python peers.py --row torchrec|torch --train 'DIR/train-*.tsv*' --test 'DIR/test-*.tsv*' \\
        --scale 0.01 --cap 40000000 --batch 1024 --out result.json

Both rows train exactly the same model on the same batches, one torch thread, one process:

- ``torchrec``: the embedding tables are TorchRec's ``FusedEmbeddingBagCollection``: FBGEMM's CPU
  table-batched embedding bag (``SplitTableBatchedEmbeddingBagsCodegen``, all 26 tables in one
  kernel call) with ``EXACT_ROWWISE_ADAGRAD`` applied inside its backward, so no gradient of a
  table is ever materialised. This is the fair peer: it is the kernel and the optimizer that
  TorchRec's sharded modules run (an unsharded ``EmbeddingBagCollection`` with a torch optimizer
  is some 40x slower on CPU: about 3,000 against 127,000 samples/s on 26 tables of 100,000 rows,
  embeddings alone, batch 1024, one thread), without a process group to shard
  over when there is one process.
- ``torch``: what a PyTorch user writes without TorchRec: one ``nn.EmbeddingBag(mode="sum",
  sparse=True)`` per table and ``torch.optim.Adagrad`` on their sparse gradients (element-wise
  Adagrad, the only Adagrad torch has; TorchRec's is row-wise).

The dense MLPs use ``torch.optim.Adagrad`` in both rows. Under the same ``--seed`` the MLPs and
the tables start from identical values in both rows (TorchRec's initialisation, uniform in
+-sqrt(1/rows), drawn table by table in the same order), so the first step's loss is the same.

The model: 13 dense features (``log(1 + max(x, 0))``, missing -> 0) -> bottom MLP 13-64-16; 26
categorical features, each a bag of ids (an id maps to row ``id % rows``; ``rows =
min(cardinality * scale, cap)``, at least 1), each pooled (sum) from its own table of dim 16;
the dot-product interaction of the 27 vectors (the 351 pairs below the diagonal) next to the
bottom output -> top MLP 367-64-1 -> logit; ``BCEWithLogits``.

Data: Criteo's layout (label, I1..I13, C1..C26, tab-separated; a categorical field is 8 hex
digits, empty when missing (id 0), several comma-separated ids when multi-hot), ``.tsv`` or
``.tsv.gz``. Every file is read and parsed (vectorised with numpy) and cut into batches before
the clock starts: ``seconds`` covers the training loop only (one pass over the training files,
the last batch possibly smaller); evaluation (log loss, exact AUC) is timed apart.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

N_DENSE, N_SPARSE, DIM = 13, 26, 16
N_FIELDS = 1 + N_DENSE + N_SPARSE
BOTTOM, TOP = (64, DIM), (64, 1)
N_PAIRS = (N_SPARSE + 1) * N_SPARSE // 2  # 351: the strictly lower triangle of the 27x27 dot products
# Criteo 1TB's categorical cardinalities as MLPerf's DLRM reference sizes its tables (dtrain.data.criteo
# has the same list; the peer venv has no dtrain); the harness passes the generator's with --cardinalities.
CRITEO_1TB_CARDINALITIES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)


# ----------------------------------------------------------------------------------------- data
def table_rows(cardinalities, scale: float, cap: int) -> list[int]:
    """Rows of each table: ``min(cardinality * scale, cap)``, rounded, at least 1 (rounded as
    examples/make_criteo_like.py counts a feature's distinct values at ``scale``)."""
    return [max(1, min(round(c * scale), cap)) for c in cardinalities]


_HEX = np.zeros(256, np.uint64)
_HEX[ord("0"):ord("9") + 1] = np.arange(10, dtype=np.uint64)
_HEX[ord("a"):ord("f") + 1] = np.arange(10, 16, dtype=np.uint64)
_HEX[ord("A"):ord("F") + 1] = np.arange(10, 16, dtype=np.uint64)


def _digits(buf: np.ndarray, ends: np.ndarray, size: np.ndarray, width: int):
    """Yield (j, the j-th character from the right of each token, whether it exists)."""
    for j in range(width):
        there = size > j
        yield j, buf[np.where(there, ends - 1 - j, 0)], there


def _parse_ints(buf, starts, ends) -> np.ndarray:
    """Decimal integers (an empty field is 0; a negative one is returned as 0, which is all the
    dense transform keeps of it)."""
    size = ends - starts
    out = np.zeros(len(starts), np.int64)
    for j, c, there in _digits(buf, ends, size, min(int(size.max(initial=0)), 18)):
        d = c.astype(np.int64) - 48
        out += np.where(there & (d >= 0) & (d <= 9), d, 0) * 10**j
    negative = (size > 0) & (buf[np.minimum(starts, len(buf) - 1)] == ord("-"))
    out[negative] = 0
    return out


def _parse_hex(buf, starts, ends) -> np.ndarray:
    """Hex ids of up to 16 digits as uint64; an empty token is the missing id 0."""
    size = ends - starts
    out = np.zeros(len(starts), np.uint64)
    for j, c, there in _digits(buf, ends, size, min(int(size.max(initial=0)), 16)):
        out |= np.where(there, _HEX[c], np.uint64(0)) << np.uint64(4 * j)
    return out


@dataclass
class Examples:
    """Parsed examples, row-major: ``ids`` holds row 0's ids of C1, then of C2, ..., then row 1's."""

    label: np.ndarray  # (n,) float32
    dense: np.ndarray  # (n, 13) float32, already log(1 + max(x, 0))
    lengths: np.ndarray  # (n, 26) int64: ids per (row, feature)
    ids: np.ndarray  # (sum(lengths),) uint64, raw (before the modulo)


def parse_file(path: str) -> Examples:
    """One Criteo-layout file, parsed without a Python loop over its lines or characters."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(data, np.uint8)
    sep = np.flatnonzero((buf == 9) | (buf == 10) | (buf == 44))  # tab, newline, comma
    kind = buf[sep]
    starts = np.empty_like(sep)
    starts[:1], starts[1:] = 0, sep[:-1] + 1
    ends = sep.copy()
    ends[(kind == 10) & (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)] -= 1  # CRLF
    field_sep = kind != 44
    field = np.cumsum(field_sep) - field_sep  # each token's field number in the file
    n = int((kind == 10).sum())
    bad = np.flatnonzero(field[kind == 10] % N_FIELDS != N_FIELDS - 1)
    col = field % N_FIELDS
    if len(bad) or int(field_sep.sum()) != n * N_FIELDS or ((kind == 44) & (col <= N_DENSE)).any():
        line = int(bad[0]) + 1 if len(bad) else "?"
        raise ValueError(f"{path}: line {line}: expected {N_FIELDS} tab-separated fields "
                         "(label, I1..I13, C1..C26; commas only inside C fields)")
    row = field // N_FIELDS
    head = col <= N_DENSE  # label and I1..I13: exactly one token each, in row-major order
    values = _parse_ints(buf, starts[head], ends[head]).reshape(n, 1 + N_DENSE)
    cat = ~head
    feature_of_row = row[cat] * N_SPARSE + (col[cat] - 1 - N_DENSE)
    return Examples(
        label=values[:, 0].astype(np.float32),
        dense=np.log1p(values[:, 1:].astype(np.float32)),
        lengths=np.bincount(feature_of_row, minlength=n * N_SPARSE).reshape(n, N_SPARSE),
        ids=_parse_hex(buf, starts[cat], ends[cat]),
    )


def load(pattern: str) -> Examples:
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no file matches {pattern!r}")
    parts = [parse_file(p) for p in paths]
    return Examples(*(np.concatenate([getattr(p, k) for p in parts])
                      for k in ("label", "dense", "lengths", "ids")))


@dataclass
class Batch:
    """One batch, the ids feature-major as TorchRec's ``KeyedJaggedTensor`` holds them: C1's bags
    of the batch's rows, then C2's, ...; ``offsets[f * B + i]`` is where row i's bag of feature f
    starts in ``values`` (``offsets`` has 26 * B + 1 entries)."""

    dense: torch.Tensor  # (B, 13) float32
    label: torch.Tensor  # (B,) float32
    values: torch.Tensor  # int64 row ids (after the modulo)
    lengths: torch.Tensor  # (26 * B,) int64
    offsets: torch.Tensor  # (26 * B + 1,) int64

    @property
    def size(self) -> int:
        return len(self.label)


def batches(ex: Examples, rows: list[int], batch: int) -> list[Batch]:
    """Map ids to rows (``id % rows``), reorder them feature-major within each batch, cut."""
    n = len(ex.label)
    per_row = ex.lengths.ravel()
    tok_row = np.repeat(np.arange(n), ex.lengths.sum(1))
    tok_feat = np.repeat(np.tile(np.arange(N_SPARSE), n), per_row)
    ids = (ex.ids % np.asarray(rows, np.uint64)[tok_feat]).astype(np.int64)
    key = ((tok_row // batch) * N_SPARSE + tok_feat) * batch + tok_row % batch
    ids = ids[np.argsort(key, kind="stable")]
    out, at = [], 0
    for lo in range(0, n, batch):
        hi = min(lo + batch, n)
        lengths = ex.lengths[lo:hi].T.ravel()  # feature-major
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        out.append(Batch(torch.from_numpy(ex.dense[lo:hi]), torch.from_numpy(ex.label[lo:hi]),
                         torch.from_numpy(ids[at:at + offsets[-1]]), torch.from_numpy(lengths),
                         torch.from_numpy(offsets)))
        at += int(offsets[-1])
    return out


# ---------------------------------------------------------------------------------------- model
def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, pooled embeddings, pairwise dot products, top MLP. ``tables`` maps a batch to
    the pooled embeddings (B, 26, 16); it is the only part the rows do differently."""

    def __init__(self, tables: nn.Module):
        super().__init__()
        self.bottom = mlp([N_DENSE, *BOTTOM], last_relu=True)
        self.top = mlp([DIM + N_PAIRS, *TOP], last_relu=False)
        self.tables = tables
        # The pairs (i > j) in torch.tril_indices' row-major order, as flat positions in the 27x27
        # product: index_select's backward (index_add) costs about half what z[:, li, lj]'s does
        # (index_put with accumulate), the same values; a third of the step on this model.
        li, lj = torch.tril_indices(N_SPARSE + 1, N_SPARSE + 1, offset=-1)
        self.register_buffer("pairs", li * (N_SPARSE + 1) + lj, persistent=False)

    def forward(self, b: Batch) -> torch.Tensor:
        x = self.bottom(b.dense)
        t = torch.cat([x.unsqueeze(1), self.tables(b)], dim=1)  # (B, 27, 16)
        z = torch.bmm(t, t.transpose(1, 2))
        return self.top(torch.cat([x, z.flatten(1).index_select(1, self.pairs)], dim=1)).squeeze(1)


class TorchRecTables(nn.Module):
    """TorchRec's FusedEmbeddingBagCollection: FBGEMM's TBE, row-wise Adagrad run in backward."""

    def __init__(self, rows: list[int], lr: float, eps: float):
        super().__init__()
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad

        self.keys = [f"C{i + 1}" for i in range(N_SPARSE)]
        self._kjt = KeyedJaggedTensor
        configs = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=r, feature_names=[k])
                   for k, r in zip(self.keys, rows, strict=True)]
        self.ebc = FusedEmbeddingBagCollection(tables=configs, optimizer_type=RowWiseAdagrad,
                                               optimizer_kwargs={"lr": lr, "eps": eps},
                                               device=torch.device("cpu"))

    def forward(self, b: Batch) -> torch.Tensor:
        kjt = self._kjt(keys=self.keys, values=b.values, lengths=b.lengths)
        return self.ebc(kjt).values().view(b.size, N_SPARSE, DIM)


class TorchTables(nn.Module):
    """Plain PyTorch: one sparse ``nn.EmbeddingBag`` per table, initialised as TorchRec does."""

    def __init__(self, rows: list[int]):
        super().__init__()
        # from_pretrained: EmbeddingBag's own constructor would draw a normal init first.
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(torch.empty(r, DIM).uniform_(-math.sqrt(1 / r), math.sqrt(1 / r)),
                                            freeze=False, mode="sum", sparse=True)
            for r in rows)

    def forward(self, b: Batch) -> torch.Tensor:
        B, o = b.size, b.offsets
        pooled = []
        for f, bag in enumerate(self.bags):
            lo, hi = int(o[f * B]), int(o[(f + 1) * B])
            pooled.append(bag(b.values[lo:hi], o[f * B:(f + 1) * B] - lo))
        return torch.stack(pooled, dim=1)


def build(row: str, rows: list[int], lr: float, eps: float, seed: int):
    """The model and the optimizers to step after backward (TorchRec's tables need none)."""
    torch.manual_seed(seed)
    bottom_top = DLRM(nn.Identity())  # the MLPs first: the same draws in both rows
    tables = TorchRecTables(rows, lr, eps) if row == "torchrec" else TorchTables(rows)
    bottom_top.tables = tables
    dense = [p for n, p in bottom_top.named_parameters() if not n.startswith("tables.")]
    optimizers = [torch.optim.Adagrad(dense, lr=lr)]
    if row == "torch":
        optimizers.append(torch.optim.Adagrad(tables.parameters(), lr=lr))
    return bottom_top, optimizers


# ------------------------------------------------------------------------------------- training
def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC by ranking (tied scores share their mean rank); NaN with one class only."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    first = np.r_[True, s[1:] != s[:-1]]
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    counts = np.diff(np.r_[starts, len(s)])
    ranks = (starts + (counts + 1) / 2.0)[group]  # 1-based mean rank of each tie group
    pos = labels[order] > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train(model: DLRM, optimizers, data: list[Batch]) -> tuple[float, float]:
    """One pass; returns (seconds, mean loss of the last 10% of the steps)."""
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    losses = torch.empty(len(data))
    t0 = time.perf_counter()
    for i, b in enumerate(data):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(b), b.label)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses[i] = loss.detach()
    seconds = time.perf_counter() - t0
    tail = max(1, len(data) // 10)
    return seconds, float(losses[-tail:].mean())


@torch.no_grad()
def evaluate(model: DLRM, data: list[Batch]) -> tuple[float, float]:
    model.eval()
    logits = torch.cat([model(b) for b in data])
    labels = torch.cat([b.label for b in data])
    logloss = float(nn.functional.binary_cross_entropy_with_logits(logits, labels))
    return logloss, auc(logits.numpy(), labels.numpy())


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(args) -> dict:
    torch.set_num_threads(1)
    cardinalities = ([int(c) for c in args.cardinalities.split(",")] if args.cardinalities
                     else list(CRITEO_1TB_CARDINALITIES))
    if len(cardinalities) != N_SPARSE:
        raise SystemExit(f"--cardinalities: {len(cardinalities)} values, expected {N_SPARSE}")
    rows = table_rows(cardinalities, args.scale, args.cap)
    t0 = time.perf_counter()
    train_data = batches(load(args.train), rows, args.batch)
    test_data = batches(load(args.test), rows, args.batch)
    load_s = time.perf_counter() - t0
    model, optimizers = build(args.row, rows, args.lr, args.eps, args.seed)
    samples = sum(b.size for b in train_data)
    seconds, train_loss = train(model, optimizers, train_data)
    t0 = time.perf_counter()
    logloss, eval_auc = evaluate(model, test_data)
    eval_s = time.perf_counter() - t0
    versions = {"torch": torch.__version__}
    if args.row == "torchrec":
        import fbgemm_gpu
        import torchrec

        versions |= {"torchrec": torchrec.__version__, "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?")}
    return {
        "row": args.row, "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
        "eval_logloss": logloss, "eval_auc": eval_auc, "eval_seconds": eval_s, "rss_mb": peak_rss_mb(),
        "eval_samples": sum(b.size for b in test_data), "steps": len(train_data), "batch": args.batch,
        "train_loss_last_10pct": train_loss, "load_seconds": load_s, "table_rows": rows,
        "table_rows_total": sum(rows), "lr": args.lr, "seed": args.seed, "threads": torch.get_num_threads(),
        "versions": versions, "python": sys.executable,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", required=True, choices=["torchrec", "torch"])
    ap.add_argument("--train", required=True, help="glob of the training files (.tsv or .tsv.gz)")
    ap.add_argument("--test", required=True, help="glob of the held-out files")
    ap.add_argument("--scale", type=float, default=0.01, help="table rows = min(cardinality * scale, cap)")
    ap.add_argument("--cap", type=int, default=40_000_000)
    ap.add_argument("--cardinalities", default="",
                    help="26 comma-separated cardinalities (default: Criteo 1TB's, as MLPerf counts them)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eps", type=float, default=1e-8, help="row-wise Adagrad's eps (TorchRec row)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
