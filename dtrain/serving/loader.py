"""An exported model (``dtrain export``, dtrain/chief/export.py) for inference: the dense part in
memory, each table memory-mapped, so a lookup reads only the rows it asks for (a table larger than
the machine's memory serves all the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtrain.model.build import build_model
from dtrain.model.ids import home_part
from dtrain.model.tables import tables_of
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.tables import table_ids

FORMAT = 1


class ExportedModel:
    """``ExportedModel(path)``: ``lookup(table, ids)`` -> rows; ``predict(x)`` -> the model's output
    on a batch (packed records for a recommendation model), each table's rows looked up from the
    files. An id a table without a vocabulary does not hold reads zeros, as in training's evaluation."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_path = self.path / "export.json"
        try:
            self.index: dict[str, Any] = json.loads(index_path.read_text())
        except OSError as exc:
            raise ValueError(f"{index_path}: cannot be read ({exc}): not an export of dtrain export") from None
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: export format {self.index.get('format')!r}, this dtrain reads {FORMAT}")
        self.step = int(self.index["step"])
        self.spec = PipelineSpec.model_validate(self.index["spec"], context={"check_files": False})
        self.model = build_model(self.spec, gathered_tables=True)
        dense = torch.load(self.path / self.index["dense"], weights_only=True, map_location="cpu")
        missing = set(dict(self.model.named_parameters())) - set(dense) - set(self.index["tables"])
        if missing:
            raise ValueError(f"{self.path}: model.pt lacks {', '.join(sorted(missing)[:5])}")
        self.model.load_state_dict(dense, strict=False)
        self.model.eval()
        self._tables = {name: self._open(entry) for name, entry in self.index["tables"].items()}

    def _open(self, entry: dict[str, Any]) -> Any:
        if entry["kind"] == "fixed":
            return np.load(self.path / entry["file"], mmap_mode="r")
        return [(np.load(self.path / p["ids"], mmap_mode="r"), np.load(self.path / p["rows"], mmap_mode="r"))
                for p in entry["parts"]]

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``ids`` (int64) in ``table`` (its weight name, e.g. ``tables.C1.weight``)."""
        t = self._tables[table]
        arr = ids.detach().cpu().numpy().astype(np.int64, copy=False)
        if isinstance(t, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(t[arr]))
        out = np.zeros((len(arr), int(self.index["tables"][table]["dim"])), dtype=np.float32)
        parts = home_part(torch.from_numpy(arr), len(t)).numpy() if len(arr) else np.zeros(0, np.int64)
        for p, (keys, rows) in enumerate(t):
            mine = np.flatnonzero(parts == p)
            if not len(mine) or not len(keys):
                continue
            pos = np.searchsorted(keys, arr[mine]).clip(max=len(keys) - 1)
            hit = keys[pos] == arr[mine]
            out[mine[hit]] = rows[pos[hit]]
        return torch.from_numpy(out)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output on the batch ``x`` (as training fed it)."""
        model = self.spec.model
        assert model is not None  # an export holds a model
        wanted = table_ids(self.model, x, record=model.module is not None)
        for name, table in tables_of(self.model):
            table.gather(wanted[name], self.lookup(name, wanted[name]))
        return self.model(x)
