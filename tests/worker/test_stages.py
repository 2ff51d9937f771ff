"""A pipeline stage on its own (no cluster): it holds only its own layers, and their memory only."""

from __future__ import annotations

import os
import sys

import psutil
import pytest
import torch

import dtrain
from dtrain.plan.job import link_shape, stage_job
from dtrain.worker.stages import StageModel


def reset_peak() -> None:
    """Reset this process's peak RSS (Linux: VmHWM), so the next reading is the peak from now on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def spec(width: int) -> dtrain.PipelineSpec:
    return dtrain.loads(f"""
name: lean-stage
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  input_shape: [{width}]
  layers:
    - {{type: linear, out: {width}, device: /job:worker/task:0}}
    - {{type: batch_norm1d, device: /job:worker/task:1}}
    - {{type: linear, out: 10, device: /job:worker/task:1}}
data: {{source: synthetic, num_samples: 64, batch_size: 8}}
training: {{microbatches: 2}}
""", base_dir=".")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets the peak RSS in /proc")
def test_a_later_stage_allocates_only_its_own_layers():
    """The first layer is 12,000 x 12,000 floats (576 MB): the second stage must not build it."""
    s = spec(12_000)
    plan = dtrain.compile(s)
    rss = psutil.Process(os.getpid()).memory_info().rss
    reset_peak()
    job = stage_job(s, plan, 0, 1)
    stage = StageModel(job, up=None, down=None)
    grown = peak() - rss
    assert grown < 200 << 20, f"building the stage took the process's peak {grown >> 20} MB higher"
    names = [n for n, _ in stage.model.named_parameters()]
    assert names == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert job.shard_layout().shard_numel == [12_000 * 2 + 12_000 * 10 + 10]
    # Buffers are initialised, not left as the empty memory they were materialised in.
    bn = stage.model.get_submodule("1")
    assert torch.equal(bn.running_mean, torch.zeros(12_000)) and torch.equal(bn.running_var, torch.ones(12_000))


def test_the_link_regions_hold_a_micro_batch_and_its_labels():
    s = spec(16)
    plan = dtrain.compile(s)
    microbatches, capacity = link_shape(s, plan, 0)
    assert microbatches == 2
    assert capacity >= 4 * 4 * 16 + 4 * 8 and capacity % 64 == 0  # 4 examples of 16 floats, int64 labels
    off = dtrain.loads(s.model_dump_json(), base_dir=".", overrides=["training.shared_memory=false"])
    assert link_shape(off, plan, 0) is None


def _pair() -> tuple:
    """A stage link on 127.0.0.1: (upstream end, downstream end)."""
    import threading

    from dtrain.dataplane.links import StageListener, connect

    listener = StageListener("127.0.0.1", b"s" * 32)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("down", listener.accept("test", 10.0)))
    t.start()
    try:
        up = connect("127.0.0.1", listener.port, b"s" * 32, "test", 10.0)
    finally:
        t.join()
    return up, out["down"]


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize(("second", "error"), [(0, "micro-batch 0 came back a second time"),
                                               (7, "micro-batch 7 came back in a step of 2 micro-batches")])
def test_a_gradient_for_a_wrong_micro_batch_fails_the_step_naming_it(position, second, error):
    """The stage after this one sends back the gradients of micro-batches 0 and then ``second``: a
    repeated index (one backward applied twice) or one past the step's micro-batches (indexing
    nothing) fails the step with a StageError naming it, not a torch or an IndexError."""
    from dtrain.dataplane.links import BACKWARD, FORWARD
    from dtrain.worker.stages import StageError

    s = dtrain.loads("""
name: bad-microbatch
cluster: {jobs: {ps: 1, worker: 3}}
model:
  input_shape: [8]
  layers:
    - {type: linear, out: 6, device: /job:worker/task:0}
    - {type: linear, out: 5, device: /job:worker/task:1}
    - {type: linear, out: 3, device: /job:worker/task:2}
  loss: cross_entropy
data: {source: synthetic, num_samples: 64, batch_size: 8}
training: {microbatches: 2, shared_memory: false}
""", base_dir=".")
    plan = dtrain.compile(s)
    assert plan.stage_positions == 3
    links = []
    try:
        down, below = _pair()  # this stage's downstream link; ``below``: the next stage's end
        links += [down, below]
        up = None
        if position == 1:
            above, up = _pair()  # ``above``: stage 0's end
            links += [above, up]
            for mb in range(2):
                above.send(FORWARD, mb, (torch.randn(4, 6), torch.zeros(4, dtype=torch.int64)), loss=0.5, count=2)
        width = 6 if position == 0 else 5  # this stage's output
        for mb in (0, second):  # queued before the step: the stage reads them in this order
            below.send(BACKWARD, mb, (torch.ones(4, width),))
        stage = StageModel(stage_job(s, plan, 0, position), up=up, down=down)
        with pytest.raises(StageError, match=error):
            stage.step(stage.grad_bufs[0])
        stage.batches.close()
    finally:
        for link in links:
            link.close()


def test_a_first_stage_waiting_for_its_ps_stops_once_abandoned_and_stops_the_next_stage():
    """A stage task asks ``abandoned`` as a replica does (a deployed cluster's killed chief: its
    tasks are cancelled, their threads run on): the first stage, waiting on a ps that never answers,
    stops within seconds (Abandoned), not at the ps's timeout (120 s), and its STOP reaches the
    stage after it (fails if run_stage drops the check, or ends without telling the next stage)."""
    import time
    from concurrent.futures import Future

    from dtrain.dataplane.links import FORWARD, STOP
    from dtrain.worker.replica import Abandoned
    from dtrain.worker.stages import run_stage

    class Silent:  # a ps that never answers
        def pull(self, *args, **kwargs):
            return Future()

    s = spec(8)
    plan = dtrain.compile(s)
    job = stage_job(s, plan, 0, 0)
    down, below = _pair()
    try:
        gone_at = time.monotonic() + 0.5
        t0 = time.monotonic()
        with pytest.raises(Abandoned):
            run_stage(job, [Silent() for _ in job.shards], None, down, abandoned=lambda: time.monotonic() > gone_at)
        assert time.monotonic() - t0 < 10
        kinds = []
        while not kinds or kinds[-1] == FORWARD:
            kinds.append(below.receive(timeout=5).kind)
        assert kinds[-1] == STOP, kinds
    finally:
        below.close()
        down.close()
