"""A ps task's checkpoint part (ps/part_writer.py): written from a copy-on-write snapshot by a
forked writer (the state as it was when the write started, whatever the task does meanwhile),
durable and atomic (a killed writer leaves no part under the final name), checked against its
manifest entry when read back (size, sha256, format), one writer at a time, and the same file
when written in the calling thread (where forking is not safe)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch

from dtrain.ps.part_writer import BadPartError, PartWriter, read_part_file

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the background writer forks")


def _state(rows: int = 1 << 20) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"params": torch.randn(1000, generator=g), "step": 7,
            "tables": {"t": {"weight": torch.randn(rows, 16, generator=g).to(torch.bfloat16),
                             "optimizer": {"step": 3, "sum": torch.rand(rows, generator=g)},
                             "fresh": torch.zeros(rows, dtype=torch.bool)}}}


def _written(writer: PartWriter) -> dict:
    done = writer.poll(wait=True)
    assert done is not None and "error" not in done, done
    return done


def test_the_part_holds_the_state_as_it_was_when_the_write_started(tmp_path):
    """Fails if the writer saved the live tensors after the task moved on (no snapshot): the task
    overwrites them right after start() returns, while its 48 MiB part is still being written."""
    state = _state()
    expected = {"params": state["params"].clone(), "weight": state["tables"]["t"]["weight"].clone()}
    writer = PartWriter(fork=True)
    assert writer.start(tmp_path, "shard-00000.pt", state, 7) == {"started": 7, "background": True}
    state["params"].fill_(-1.0)  # training goes on in the task
    state["tables"]["t"]["weight"].fill_(5.0)
    done = _written(writer)
    got = read_part_file(tmp_path / done["file"], done["bytes"], done["sha256"])
    assert got["step"] == 7 and got["tables"]["t"]["optimizer"]["step"] == 3
    assert torch.equal(got["params"], expected["params"])
    assert torch.equal(got["tables"]["t"]["weight"], expected["weight"])
    assert got["tables"]["t"]["weight"].dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.json", "shard-00000.pt"]  # no temp file left


def test_one_writer_at_a_time_and_its_outcome_once_done(tmp_path):
    writer = PartWriter(fork=True, exit_wait_s=0.0)
    assert writer.poll() == {"step": None, "error": "no checkpoint part was started on this task"}
    writer.start(tmp_path, "a.pt", _state(), 1)
    refused = writer.start(tmp_path, "b.pt", _state(16), 2)  # fails if two writers could share a task
    assert refused == {"error": "the part of step 1 is still being written"}
    done = _written(writer)
    assert done["step"] == 1 and done["file"] == "a.pt" and not (tmp_path / "b.pt").exists()
    assert writer.poll() == done  # the outcome stays until the next start
    assert writer.start(tmp_path, "b.pt", _state(16), 2)["started"] == 2
    assert _written(writer)["file"] == "b.pt"


def test_a_killed_writer_leaves_no_part_and_says_so(tmp_path):
    """SIGKILL of the writer mid-write: no file under the part's name (the chief never commits a
    checkpoint without every part), and the outcome names the signal."""
    writer = PartWriter(fork=True)
    writer.start(tmp_path, "shard-00000.pt", _state(1 << 22), 3)  # 192 MiB: still writing when killed
    os.kill(writer._child[0], signal.SIGKILL)  # at once: saving, fsyncing and hashing 144 MiB come first
    done = writer.poll(wait=True)
    assert done["step"] == 3 and done["error"] == "the checkpoint writer killed by signal 9"
    assert not (tmp_path / "shard-00000.pt").exists()


def test_in_thread_writing_makes_the_same_part(tmp_path):
    state = _state(1000)
    forked, inline = PartWriter(fork=True), PartWriter(fork=False)
    forked.start(tmp_path / "f", "p.pt", state, 4)
    assert inline.start(tmp_path / "i", "p.pt", state, 4) == {"started": 4, "background": False}
    a, b = _written(forked), _written(inline)
    ga = read_part_file(tmp_path / "f" / "p.pt", a["bytes"], a["sha256"])
    gb = read_part_file(tmp_path / "i" / "p.pt", b["bytes"], b["sha256"])
    assert torch.equal(ga["tables"]["t"]["weight"], gb["tables"]["t"]["weight"])
    assert torch.equal(ga["params"], gb["params"])


def test_a_part_that_is_not_the_manifest_s_is_refused(tmp_path):
    """Truncated, one byte flipped, or not a part at all: BadPartError naming the file (the
    session then moves the checkpoint aside and restores the previous one)."""
    writer = PartWriter(fork=False)
    writer.start(tmp_path, "p.pt", _state(1000), 1)
    done = _written(writer)
    path = tmp_path / "p.pt"
    data = path.read_bytes()
    with pytest.raises(BadPartError, match=f"{path}: {len(data)} bytes, the manifest says {len(data) + 1}"):
        read_part_file(path, len(data) + 1, done["sha256"])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(BadPartError, match="sha256 mismatch"):
        read_part_file(path, done["bytes"], done["sha256"])
    other = tmp_path / "other.pt"
    torch.save({"params": torch.zeros(2)}, other)
    size = other.stat().st_size
    with pytest.raises(BadPartError, match="not a checkpoint part"):
        read_part_file(other, size, hashlib.sha256(other.read_bytes()).hexdigest())


def test_the_writer_holds_none_of_the_task_s_files(tmp_path):
    """A lock the task held when it forked (an in-process ps shares the chief's process, and its run
    directory's lock) comes free once the task lets it go, long before the writer is done (it
    closes what it inherited as it starts): fails if the writer kept the task's open files, the
    lock then held until its 288 MiB are written, fsynced and hashed."""
    import fcntl

    lock = tmp_path / ".lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    writer = PartWriter(fork=True)
    writer.start(tmp_path / "parts", "p.pt", _state(1 << 23), 1)
    os.close(fd)  # the task's run ends
    again = os.open(lock, os.O_RDWR)
    deadline = time.monotonic() + 0.5
    try:
        while True:
            try:
                fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the writer holds the task's lock"
                time.sleep(0.005)
    finally:
        os.close(again)
    _written(writer)


def test_a_part_built_in_the_writer_after_the_task_used_its_thread_pool(tmp_path):
    """A delta's rows are picked out in the forked writer with torch ops. The task has used its
    OpenMP pool (every apply does), which does not survive a fork: a parallel op in the writer
    waited on it forever (a checkpoint that never commits) until the writer ran single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        marks = torch.zeros(1 << 24, dtype=torch.bool)
        marks[::7] = True
        assert int(torch.nonzero(marks).shape[0]) > 0  # (the pool is up: a parallel region ran here)
        writer = PartWriter()
        writer.start(tmp_path, "p.pt", lambda: {"rows": torch.nonzero(marks).flatten()}, step=1)
        deadline = time.monotonic() + 30
        while (done := writer.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        writer.close()  # (a hung writer is killed: the assertion says what happened)
        assert done is not None and "error" not in done, done
        assert torch.equal(read_part_file(tmp_path / "p.pt", done["bytes"], done["sha256"])["rows"],
                           torch.arange(0, 1 << 24, 7))
    finally:
        torch.set_num_threads(threads)
