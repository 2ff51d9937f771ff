"""Load a trained ``model.pt`` into ``dtrain.build_model(spec)`` and predict with plain torch.

    python examples/load_model_for_inference.py [RUN_DIR]    # default runs/example-inference
    STEPS=300 PIPELINE=pipelines/digits_async.yaml python examples/load_model_for_inference.py

When ``RUN_DIR/model.pt`` is missing, this first trains ``PIPELINE`` for ``STEPS`` steps with
``dtrain.run(spec, run_dir=RUN_DIR)`` on the embedded cluster (worker processes started and
stopped by dtrain). Pass ``runs/digits-async`` after ``make run`` to use that model instead: the
model must come from ``PIPELINE`` (a run directory does not record its pipeline; ``model.pt`` holds
weights only).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import distributed  # imported here so that its logging can be quieted below (dtrain imports it lazily)
import torch

import dtrain
from dtrain.data.sources import load_dataset

RUN_DIR = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RUN_DIR", "runs/example-inference"))
PIPELINE = os.environ.get("PIPELINE", "pipelines/digits_async.yaml")
STEPS = int(os.environ.get("STEPS", 300))
SAMPLES = int(os.environ.get("SAMPLES", 16))


def main() -> None:
    # The embedded cluster's scheduler runs in this process: only its warnings, not Dask's INFO lines.
    logging.getLogger(distributed.__name__).setLevel(logging.WARNING)
    # The pipeline that trained the model: build_model needs its `model` section (and seed).
    spec = dtrain.load(PIPELINE, overrides=[f"training.steps={STEPS}", "hooks=[]"])
    if not (RUN_DIR / "model.pt").is_file():
        print(f"training {spec.name} for {STEPS} steps into {RUN_DIR} ...")
        dtrain.run(spec, run_dir=RUN_DIR)
    else:
        print(f"reusing {RUN_DIR / 'model.pt'}")

    # The same architecture, then the trained weights (a plain state_dict of tensors).
    model = dtrain.build_model(spec)
    model.load_state_dict(torch.load(RUN_DIR / "model.pt", weights_only=True))
    model.eval()

    # The test split exactly as training made it: same seed, standardised with the training
    # split's mean and std (model.pt holds weights only, not this preprocessing).
    data = load_dataset(spec.data.source, base_dir=spec.base_dir, target=spec.data.target,
                        test_fraction=spec.data.test_fraction, standardize=spec.data.standardize,
                        seed=spec.training.seed)
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    with torch.no_grad():
        pred = model(x).argmax(dim=1)

    few = slice(0, SAMPLES)
    print("predicted:", pred[few].tolist())
    print("true:     ", y[few].tolist())
    print(f"accuracy on {SAMPLES} test samples: {(pred[few] == y[few]).float().mean().item():.4f}")
    summary = json.loads((RUN_DIR / "summary.json").read_text())
    print(f"accuracy on all {len(y)} test samples: {(pred == y).float().mean().item():.4f} "
          f"(summary.json: {summary['eval']['accuracy']:.4f})")


if __name__ == "__main__":  # needed when dtrain.run starts worker processes (they re-import this file)
    main()
