"""A checkpoint's size is checked against its manifest before a byte of it is read (review M8):
a huge bogus ``ckpt-*.pt`` beside a manifest must not be read into the chief's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.chief import checkpoint as ckpt


def test_verify_checks_size_before_reading(tmp_path, monkeypatch):
    directory = ckpt.checkpoint_dir(tmp_path)
    directory.mkdir(parents=True)
    path = directory / "ckpt-00000010.pt"
    with open(path, "wb") as f:  # a sparse 1 GB file: no disk used, but reading it would take 1 GB of memory
        f.truncate(1 << 30)
    path.with_suffix(".json").write_text(json.dumps({"step": 10, "file": path.name, "bytes": 10,
                                                     "sha256": "0" * 64, "pipeline_hash": "x"}))
    read = []
    real_read_bytes = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.suffix == ".pt":
            read.append(self.name)
            raise AssertionError(f"{self.name} was read before its size was checked")
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(ValueError, match=r"ckpt-00000010\.pt: 1073741824 bytes, manifest says 10"):
        ckpt.verify(path)
    assert read == []
    assert ckpt.latest(tmp_path) is None  # skipped with a warning, never read
    assert read == []
