"""``dtrain export``: a checkpoint as a model for serving, without the optimizer state.

Written into ``OUT/``::

    export.json           the index: format, step, the pipeline (as JSON data), the dense part's
                          file and each table's files (``dtrain.serving`` reads it)
    model.pt              the dense parameters: a state_dict for ``torch.load(..., weights_only=True)``
                          into ``dtrain.build_model(spec)`` with ``strict=False`` (the tables are
                          the files below)
    tables/<name>.npy     a fixed table: (num_embeddings, dim) float32, row i = id i's row
    tables/<name>.<p>.ids.npy, tables/<name>.<p>.rows.npy
                          a table without a vocabulary, per ps part p: its ids, sorted, and their
                          rows (an id lives on part ``home_part(id, parts)``: dtrain.model.ids)

Every table file is a plain ``.npy`` that ``numpy.load(..., mmap_mode="r")`` maps without reading
it. The checkpoint is read one part at a time (each memory-mapped) and each table written row
block by row block, so the exporter holds one table part at most; rows not drawn yet (a fixed
table's rows are drawn on first use) get their initial values, as training would have given them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.errors import RunDirError
from dtrain.plan.compiler import compile
from dtrain.plan.layout import ShardLayout
from dtrain.plan.tables import table_config
from dtrain.ps.groups import table_part
from dtrain.spec.pipeline import PipelineSpec

from . import checkpoint as ckpt_io
from .files import atomic_write

EXPORT_FORMAT = 1
ROW_BLOCK = 1 << 20  # rows converted and written at a time


def model_section(spec_data: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's pipeline as data, without what does not define the model (its hooks: custom
    ones need not be importable where the model is served)."""
    return {**spec_data, "hooks": []}


def pick(run_dir: Path, step: int | None) -> ckpt_io.Checkpoint:
    """The newest valid checkpoint of ``run_dir``, or the one of ``step`` (RunDirError otherwise)."""
    paths = ckpt_io.list_checkpoints(run_dir)
    if not paths:
        raise RunDirError(f"{run_dir} holds no checkpoint (checkpoints/ckpt-<step>)")
    if step is None:
        found = ckpt_io.latest(run_dir)
        assert found is not None
        return found
    chosen = [p for p in paths if ckpt_io._step_of(p) == step]
    if not chosen:
        steps = ", ".join(str(ckpt_io._step_of(p)) for p in paths)
        raise RunDirError(f"{run_dir} has no checkpoint of step {step} (it has {steps})")
    try:
        return ckpt_io.Checkpoint(step, chosen[0], ckpt_io.verify(chosen[0]))
    except ValueError as exc:
        raise RunDirError(f"checkpoint {chosen[0]} is invalid: {exc}") from None


def _part_states(checkpoint: ckpt_io.Checkpoint) -> Any:
    """Each shard's state in shard order, one at a time (a part read when it is reached)."""
    if checkpoint.parts is None:  # the single-file format: read whole
        yield from checkpoint.payload["shards"]
        return
    for part in sorted(checkpoint.parts, key=lambda p: int(p["shard"])):
        yield ckpt_io.read_part(checkpoint.path, part)  # (a delta: its chain merged)


def export(run_dir: Path, out: Path, step: int | None = None) -> dict[str, Any]:
    """Write the export of ``run_dir``'s checkpoint (the newest, or ``step``'s) into ``out`` (which
    must not exist, or be empty); returns the index (``export.json``)."""
    checkpoint = pick(Path(run_dir), step)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise RunDirError(f"{out} is not empty: export into a new directory")
    payload = checkpoint.payload
    spec = PipelineSpec.model_validate(model_section(payload["spec"]), context={"check_files": False})
    plan = compile(spec)
    written = payload.get("layout") or {}
    layout = ShardLayout.from_description(written) if written.get("parts") else ShardLayout.from_plan(plan)
    from dtrain.model.build import build_model

    skeleton = build_model(spec, gathered_tables=True)  # (gathered: its tables hold no rows)
    table_names = {t.name for t in plan.tables}
    shapes = {n: p.shape for n, p in skeleton.named_parameters() if n not in table_names}
    (out / "tables").mkdir(parents=True, exist_ok=True)
    tables: dict[str, Any] = {}
    fixed: dict[str, np.memmap[Any, Any]] = {}
    for t in plan.tables:
        stem = t.name.removesuffix(".weight")
        if t.dynamic is None:
            rel = f"tables/{stem}.npy"
            fixed[t.name] = np.lib.format.open_memmap(out / rel, mode="w+", dtype=np.float32,
                                                      shape=(t.num_embeddings, t.dim))
            tables[t.name] = {"kind": "fixed", "file": rel, "rows": t.num_embeddings, "dim": t.dim}
        else:
            tables[t.name] = {"kind": "dynamic", "dim": t.dim, "parts": [None] * len(t.parts)}
    params: list[torch.Tensor] = []
    run_optimizer = spec.optimizer.model_dump()
    for shard, state in enumerate(_part_states(checkpoint)):
        params.append(state["params"].clone())
        for t in plan.tables:
            for p in t.parts:
                if p.shard == shard:
                    _export_part(t, p.part, state["tables"][t.name], spec.training.seed, run_optimizer,
                                 fixed.get(t.name), out, tables[t.name])
        del state
    for arr in fixed.values():
        arr.flush()
    dense = layout.unpack(params, shapes)
    atomic_write(out / "model.pt", lambda f: torch.save(dense, f))
    index = {"format": EXPORT_FORMAT, "step": checkpoint.step, "checkpoint": checkpoint.path.name,
             "spec": model_section(payload["spec"]), "dense": "model.pt", "tables": tables}
    atomic_write(out / "export.json", (json.dumps(index, indent=1) + "\n").encode())
    return index


def _export_part(table: Any, part_index: int, state: dict[str, Any], seed: int, run_optimizer: dict[str, Any],
                 target: np.ndarray | None, out: Path, entry: dict[str, Any]) -> None:
    """One ps part of one table into the export: a fixed table's rows into ``target`` (undrawn
    rows drawn), a dynamic table's live ids and rows into files of their own."""
    part = table_part(table_config(table, part_index, seed), run_optimizer)
    part.load_state(state)
    if table.dynamic is None:
        n = len(part.rows)
        for lo in range(0, n, ROW_BLOCK):
            hi = min(lo + ROW_BLOCK, n)
            rows = part.chunk(lo, hi)["weight"].to(torch.float32).numpy()
            r = part.rows
            assert target is not None  # a fixed table's rows go into its file
            target[r.start + lo * r.step:r.start + hi * r.step:r.step] = rows
        return
    live = part.chunk(0, len(part.ids))
    order = torch.argsort(live["ids"])
    stem = table.name.removesuffix(".weight")
    ids_rel, rows_rel = f"tables/{stem}.{part_index}.ids.npy", f"tables/{stem}.{part_index}.rows.npy"
    np.save(out / ids_rel, live["ids"][order].numpy())
    np.save(out / rows_rel, live["weight"][order].to(torch.float32).numpy())
    entry["parts"][part_index] = {"ids": ids_rel, "rows": rows_rel, "count": int(len(order))}


def remove_partial(out: Path) -> None:
    """An export that failed leaves nothing behind."""
    shutil.rmtree(out, ignore_errors=True)
