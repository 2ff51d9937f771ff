"""Evaluation metrics that merge across batches and shards. Pure torch."""

from __future__ import annotations

import torch

AUC_BINS = 1 << 14


class AucHistogram:
    """ROC AUC of a binary classifier's logits, accumulated over any number of batches: positives and
    negatives counted per bin of predicted probability (``AUC_BINS`` equal bins over [0, 1], as
    ``tf.keras.metrics.AUC(num_thresholds=...)`` approximates it); examples in one bin count as
    ties (half). Exact for scores that do not share a bin."""

    def __init__(self, bins: int = AUC_BINS):
        self.bins = bins
        self.pos = torch.zeros(bins, dtype=torch.float64)
        self.neg = torch.zeros(bins, dtype=torch.float64)

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        p = torch.sigmoid(logits.detach().reshape(-1).double().cpu())
        t = targets.detach().reshape(-1).cpu() > 0.5
        b = (p * self.bins).long().clamp_(0, self.bins - 1)
        self.pos += torch.bincount(b[t], minlength=self.bins).double()
        self.neg += torch.bincount(b[~t], minlength=self.bins).double()

    def value(self) -> float | None:
        """The AUC, or None without both classes."""
        pos, neg = float(self.pos.sum()), float(self.neg.sum())
        if not pos or not neg:
            return None
        below = torch.cumsum(self.neg, 0) - self.neg  # negatives in lower bins
        return float(((below + 0.5 * self.neg) * self.pos).sum()) / (pos * neg)
