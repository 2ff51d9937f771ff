"""Checkpoints: atomic files with a manifest, retention, the newest *valid* one used to resume
(a truncated, corrupted or manifest-less one is moved aside into checkpoints/invalid/ with a
warning, never deleted; one that cannot be read, or a directory of only invalid ones, stops the
resume), loading with ``weights_only=True``; and sync runs on the in-process cluster that write
consistent checkpoints at exact steps and resume from them, also under another placement."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.errors import RunDirError
from dtrain.plan.layout import ShardLayout
from tests.helpers.pipelines import pipeline_yaml

LOGGER = "dtrain.chief.checkpoint"


def _shards(step: int, n: int = 2) -> list[dict]:
    return [{"params": torch.arange(4, dtype=torch.float32) + 10 * s + step, "step": step,
             "optimizer_state": {"0": {"momentum_buffer": torch.ones(4)}}, "dropped_stale": 0, "samples": 32 * step}
            for s in range(n)]


def _save(run_dir: Path, step: int, keep: int = 10) -> Path:
    return ckpt.save(run_dir, step, _shards(step), spec_data={"name": "t", "training": {"steps": 100}},
                     pipeline_hash="abc", replicas={"local_steps": {"0": step}}, keep=keep)


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt.checkpoint_dir(run_dir).iterdir())


# ----------------------------------------------------------------------------- files and manifest


def test_save_writes_checkpoint_and_manifest_atomically(tmp_path):
    path = _save(tmp_path, 500)
    assert path == tmp_path / "checkpoints" / "ckpt-00000500.pt"
    assert _names(tmp_path) == ["ckpt-00000500.json", "ckpt-00000500.pt"]  # no temp file left behind
    data = path.read_bytes()
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest == {"step": 500, "file": "ckpt-00000500.pt", "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(), "pipeline_hash": "abc",
                        "time": manifest["time"]}  # the write time: keep_every_n_hours reads it
    assert manifest["time"] == torch.load(path, weights_only=True)["time"]
    payload = torch.load(path, weights_only=True)
    assert payload["step"] == 500 and payload["pipeline_hash"] == "abc" and payload["format"] == ckpt.FORMAT
    assert torch.equal(payload["shards"][1]["params"], _shards(500)[1]["params"])
    assert payload["replicas"] == {"local_steps": {"0": 500}}
    assert ckpt.verify(path)["step"] == 500


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 10)
    assert _names(tmp_path) == []


def test_retention_keeps_newest_n(tmp_path):
    _save(tmp_path, 5)
    stale = ckpt.checkpoint_dir(tmp_path) / ".ckpt-00000007.json.tmp-999999999-abcd"  # a writer killed mid-save
    stale.write_text("{")
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep=2)
    assert _names(tmp_path) == ["ckpt-00000030.json", "ckpt-00000030.pt", "ckpt-00000040.json",
                                "ckpt-00000040.pt"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000030.pt", "ckpt-00000040.pt"]


def test_steps_past_eight_digits_still_listed_in_step_order(tmp_path):
    for step in (5, 99_999_999, 100_000_000):
        _save(tmp_path, step)
    assert [ckpt._step_of(p) for p in ckpt.list_checkpoints(tmp_path)] == [5, 99_999_999, 100_000_000]
    assert ckpt.latest(tmp_path).step == 100_000_000


def test_latest_is_newest_valid(tmp_path):
    assert ckpt.latest(tmp_path) is None
    for step in (10, 30, 200):
        _save(tmp_path, step)
    found = ckpt.latest(tmp_path)
    assert found.step == 200 and found.path.name == "ckpt-00000200.pt"
    assert torch.equal(found.payload["shards"][0]["params"], _shards(200)[0]["params"])


# ----------------------------------------------------------------------------- invalid newest ones


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_manifest(path: Path) -> None:
    path.with_suffix(".json").unlink()


@pytest.mark.parametrize(("damage", "reason"), [(_truncate, "truncated"), (_flip_byte, "sha256 mismatch"),
                                                (_drop_manifest, "manifest")])
def test_damaged_newest_falls_back_to_previous_and_is_moved_aside(tmp_path, caplog, damage, reason):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    damage(newest)
    with pytest.raises(ValueError, match=reason):
        ckpt.verify(newest)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = ckpt.latest(tmp_path)
    assert found is not None and found.step == 10
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    assert len(warnings) == 1 and "ckpt-00000020.pt" in warnings[0].getMessage()
    assert reason in warnings[0].getMessage()
    # kept, out of the way: never deleted, never tried again first
    assert (ckpt.checkpoint_dir(tmp_path) / "invalid" / "ckpt-00000020.pt").exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000010.pt"]


def test_no_valid_checkpoint_is_an_error_not_a_restart_from_zero(tmp_path):
    _truncate(_save(tmp_path, 10))
    _flip_byte(_save(tmp_path, 20))
    with pytest.raises(ckpt.CheckpointError, match=r"no valid checkpoint.*ckpt-00000020.pt.*sha256.*ckpt-00000010.pt"):
        ckpt.latest(tmp_path)
    assert sorted(p.name for p in (ckpt.checkpoint_dir(tmp_path) / "invalid").iterdir()) == [
        "ckpt-00000010.json", "ckpt-00000010.pt", "ckpt-00000020.json", "ckpt-00000020.pt"]


def test_an_unreadable_checkpoint_stops_the_resume_and_stays(tmp_path, monkeypatch):
    """An I/O error (NFS ESTALE, EIO, permissions) may pass: never skip past the checkpoint or
    delete it, and never fall back to an older timeline."""
    import errno

    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == newest.name:
            raise OSError(errno.EIO, "Input/output error")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint .*ckpt-00000020.pt.*Input/output"):
        ckpt.latest(tmp_path)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000010.pt", "ckpt-00000020.pt"]
    assert not (ckpt.checkpoint_dir(tmp_path) / "invalid").exists()
    monkeypatch.undo()
    assert ckpt.latest(tmp_path).step == 20


def test_the_size_is_checked_before_the_file_is_read(tmp_path, monkeypatch):
    path = _save(tmp_path, 10)
    with open(path, "r+b") as f:  # a huge (sparse) file behind a manifest that says otherwise
        f.truncate(1 << 30)

    def refuse(self):
        raise AssertionError("read a file whose size was already known to be wrong")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ValueError, match="1073741824 bytes, manifest says"):
        ckpt.verify(path)


def test_a_sync_checkpoint_with_shards_at_different_steps_is_refused(tmp_path):
    shards = _shards(20)
    shards[1]["step"] = 21
    path = ckpt.save(tmp_path, 20, shards, spec_data={"name": "t", "training": {"mode": "sync"}},
                     pipeline_hash="abc")
    with pytest.raises(ValueError, match=r"different steps \[20, 21\]"):
        ckpt.verify(path)
    async_path = ckpt.save(tmp_path, 30, [dict(s, step=30 + i) for i, s in enumerate(_shards(30))],
                           spec_data={"name": "t", "training": {"mode": "async"}}, pipeline_hash="abc")
    assert ckpt.verify(async_path)["step"] == 30  # async shards count their own applies


def test_renamed_checkpoint_is_not_trusted(tmp_path):
    """A checkpoint copied under another step's name (with its manifest) is refused: the manifest
    names another file and the payload another step."""
    src = _save(tmp_path, 10)
    fake = src.with_name("ckpt-00000050.pt")
    shutil.copy(src, fake)
    shutil.copy(src.with_suffix(".json"), fake.with_suffix(".json"))
    with pytest.raises(ValueError, match="does not describe"):
        ckpt.verify(fake)
    manifest = json.loads(fake.with_suffix(".json").read_text())
    manifest["file"] = fake.name
    fake.with_suffix(".json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="holds step 10"):
        ckpt.verify(fake)
    assert ckpt.latest(tmp_path).step == 10


def test_retention_after_resuming_past_an_invalid_newest(tmp_path, caplog):
    """Resumed from ckpt 20 because ckpt 30 was truncated (and moved aside), the run's next
    checkpoint (25, keep 1) survives its own retention; the invalid one stays in invalid/."""
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    _truncate(_save(tmp_path, 30))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ckpt.latest(tmp_path).step == 20
    assert "ckpt-00000030.pt" in caplog.text
    _save(tmp_path, 25, keep=1)
    assert _names(tmp_path) == ["ckpt-00000025.json", "ckpt-00000025.pt", "invalid"]
    assert (ckpt.checkpoint_dir(tmp_path) / "invalid" / "ckpt-00000030.pt").exists()
    assert ckpt.latest(tmp_path).step == 25


def test_retention_leaves_a_valid_newer_checkpoint_alone(tmp_path):
    for step in (10, 20, 40):
        _save(tmp_path, step)
    _save(tmp_path, 30, keep=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000030.pt", "ckpt-00000040.pt"]


def _executed(path: str) -> None:  # what a malicious pickle would run
    Path(path).write_text("pwned")


class Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_executed, (self.path,))


def test_pickled_object_is_rejected_not_executed(tmp_path, caplog):
    _save(tmp_path, 10)
    marker = tmp_path / "executed"
    path = ckpt.checkpoint_dir(tmp_path) / "ckpt-00000020.pt"
    torch.save({"format": ckpt.FORMAT, "step": 20, "shards": [Evil(str(marker))]}, path)
    data = path.read_bytes()
    path.with_suffix(".json").write_text(json.dumps({"step": 20, "file": path.name, "bytes": len(data),
                                                     "sha256": hashlib.sha256(data).hexdigest()}))
    with pytest.raises(ValueError, match="cannot be loaded"):
        ckpt.verify(path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ckpt.latest(tmp_path).step == 10
    assert "ckpt-00000020.pt" in caplog.text
    assert not marker.exists()  # refused by the weights_only unpickler, never called


# ----------------------------------------------------------------------------- a real run, resumed

# fast steps: the shards pause at 20 and 40 for the chief however fast they go
SYNC = pipeline_yaml("ckpt-sync", optimizer={"name": "momentum", "lr": 0.05}, mode="sync", steps=60,
                     summary={"every_steps": 20, "tensorboard": False}, checkpoint={"every_steps": 20, "keep": 2})


def _assemble(spec: dtrain.PipelineSpec, shards: list[dict]) -> dict[str, torch.Tensor]:
    model = dtrain.build_model(spec)
    layout = ShardLayout.from_plan(dtrain.compile(spec))
    return layout.unpack([s["params"] for s in shards], {n: p.shape for n, p in model.named_parameters()})


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_run_checkpoints_consistently_and_resumes(inproc_client, run_dir):
    spec = dtrain.loads(SYNC, base_dir=".")
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    s = result.summary
    assert s["status"] == "completed" and s["global_step"] == 60
    written = s["checkpoints"]
    # The shards pause at every multiple of every_steps until the chief has its snapshot: exactly
    # these checkpoints, however fast the steps go by between the chief's polls (and step 0's,
    # written at creation as TF's CheckpointSaverHook does).
    assert written == ["ckpt-00000000", "ckpt-00000020", "ckpt-00000040", "ckpt-00000060"]
    on_disk = [p.name for p in ckpt.list_checkpoints(run_dir)]
    assert on_disk == written[-2:]  # keep: 2
    assert not [p for p in ckpt.checkpoint_dir(run_dir).iterdir() if p.name.startswith(".")]  # no temp files
    for name in on_disk:
        payload = ckpt.verify(ckpt.checkpoint_dir(run_dir) / name)
        assert len(payload["shards"]) == 2
        assert {sh["step"] for sh in payload["shards"]} == {payload["step"]}  # one consistent step
        assert all(torch.isfinite(sh["params"]).all() for sh in payload["shards"])
        assert payload["shards"][0]["optimizer_state"]  # momentum buffers are captured
    # The final checkpoint, assembled, is exactly the final model.
    newest = ckpt.latest(run_dir)
    params = _assemble(spec, newest.payload["shards"])
    final = torch.load(run_dir / "model.pt", weights_only=True)
    assert params.keys() <= final.keys()
    for name, value in params.items():
        assert torch.equal(value, final[name]), name

    # Without --resume the run directory is refused, before anything is written.
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="--resume"):
        dtrain.run(spec, client=inproc_client, run_dir=run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == before

    # Resume with more steps: starts from the newest checkpoint and appends to metrics.jsonl.
    longer = spec.model_copy(deep=True)
    longer.training.steps = 100
    result2 = dtrain.run(longer, client=inproc_client, run_dir=run_dir, resume=True)
    s2 = result2.summary
    assert s2["status"] == "completed"
    assert s2["start_step"] == newest.step == 60
    assert s2["global_step"] == 100
    steps = _steps(run_dir)
    assert (run_dir / "metrics.jsonl").read_text().startswith(before)
    first_run = len(before.splitlines())
    assert steps[first_run:] and all(60 < st <= 100 for st in steps[first_run:])
    assert 100 in steps[first_run:]
    assert [p.name for p in ckpt.list_checkpoints(run_dir)][-1] == "ckpt-00000100"
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == 60


RESHARD = pipeline_yaml("ckpt-reshard", optimizer={"name": "adam", "lr": 0.01},
                        training={"mode": "sync", "steps": 80, "seed": 3},
                        summary={"every_steps": 20, "tensorboard": False}, checkpoint={"every_steps": 40, "keep": 2})


@pytest.fixture(scope="module")
def reshard_runs(inproc_client, tmp_path_factory):
    """The uninterrupted 80-step run's parameters and the run directory of its first 40 steps
    (each resume below starts from a copy): shared by the placements."""
    spec = dtrain.loads(RESHARD, base_dir=".")
    base = tmp_path_factory.mktemp("reshard")
    ref = dtrain.run(spec, client=inproc_client, run_dir=base / "ref")
    first = spec.model_copy(deep=True)
    first.training.steps = 40
    dtrain.run(first, client=inproc_client, run_dir=base / "run")
    return ref.model.state_dict(), base / "run"


@pytest.mark.parametrize("placement", [["cluster.jobs.ps=1"], ["cluster.jobs.ps=3"], ["placement.variables=greedy"]])
def test_a_resume_under_another_placement_reshards_variables_and_adam_state(inproc_client, reshard_runs, tmp_path,
                                                                            placement):
    """Written by 2 ps tasks (round robin), resumed by 1 or 3 ps tasks or under greedy placement: every
    variable and its Adam moments and step count are regrouped, and training goes on exactly as
    an uninterrupted run's (sync, fixed seed)."""
    spec = dtrain.loads(RESHARD, base_dir=".")
    a, first_run = reshard_runs
    shutil.copytree(first_run, tmp_path / "run")
    other = dtrain.loads(RESHARD, base_dir=".", overrides=placement)
    assert ShardLayout.from_plan(dtrain.compile(other)).describe() != ShardLayout.from_plan(dtrain.compile(spec)).describe()
    resumed = dtrain.run(other, client=inproc_client, run_dir=tmp_path / "run", resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["start_step"] == 40
    assert resumed.summary["global_step"] == 80
    b = resumed.model.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
