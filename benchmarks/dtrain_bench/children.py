"""What runs in the child processes: the plain PyTorch loop, torch DDP, a dtrain run on its own
embedded cluster, and the probes it sends to the Dask workers.

Every measurement runs in a fresh subprocess: ``bench.py --child KIND --params JSON --result PATH``
(:func:`run_child`). It writes one JSON object to PATH. The parent kills the child's whole process
group on timeout. Functions here are pickled by reference (``torch.multiprocessing.spawn``'s target,
``client.run``'s probe), so they live in this importable module, not in the entry script.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .configs import ROOT, mlp_sizes, optimizer_state_factor, read_json
from .machine import LoopbackSampler, child_echo


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ plain loop and DDP
def _synthetic(p: dict[str, Any], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    n, d = p["num_samples"], p["model"]["input"]
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, p["model"]["classes"], (n,), generator=g)
    return x, y


def _torch_model(p: dict[str, Any]):
    import torch

    sizes = mlp_sizes(p["model"])
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _torch_optimizer(params: Any, opt: dict[str, Any]):
    import torch

    name, lr = opt["name"], opt["lr"]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.get("momentum", 0.0))
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=opt.get("momentum", 0.9))
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    raise ValueError(f"unknown optimizer {name}")


class _Trainer:
    """The plain PyTorch step: a batch from a preloaded tensor (shuffled each epoch, like a
    dtrain replica's data iterator), zero_grad, forward, loss, backward, SGD step."""

    def __init__(self, p: dict[str, Any], seed: int, model: Any = None):
        import torch

        torch.set_num_threads(p["threads"])
        torch.manual_seed(p["seed"])
        self.torch = torch
        self.model = model if model is not None else _torch_model(p)
        self.opt = _torch_optimizer(self.model.parameters(), p["optimizer"])
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.x, self.y = _synthetic(p, seed)
        self.b = p["batch"]
        self.xb = torch.empty(self.b, self.x.shape[1])
        self.yb = torch.empty(self.b, dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(len(self.x), generator=self.gen)
        self.pos = 0

    def step(self) -> Any:
        torch = self.torch
        if self.pos + self.b > len(self.perm):
            self.perm = torch.randperm(len(self.x), generator=self.gen)
            self.pos = 0
        idx = self.perm[self.pos:self.pos + self.b]
        self.pos += self.b
        torch.index_select(self.x, 0, idx, out=self.xb)
        torch.index_select(self.y, 0, idx, out=self.yb)
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(self.xb), self.yb)
        loss.backward()
        self.opt.step()
        return loss


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child_plain(p: dict[str, Any]) -> dict[str, Any]:
    t = _Trainer(p, p["seed"] + p.get("instance", 0))
    for _ in range(p["warmup"]):
        t.step()
    n = 0
    t0 = time.perf_counter()
    while n < p["steps"] or time.perf_counter() - t0 < p["min_seconds"]:
        loss = t.step()
        n += 1
    dt = time.perf_counter() - t0
    float(loss.detach())
    return {"status": "ok", "samples_per_sec": n * t.b / dt, "step_ms": 1e3 * dt / n, "steps": n,
            "seconds": dt, "t_start": time.time() - dt, "torch_threads": t.torch.get_num_threads(),
            "peak_rss": _peak_rss()}


def _mlp_trainer(p: dict[str, Any], rank: int, ddp: Any) -> _Trainer:
    import torch

    torch.manual_seed(p["seed"])
    return _Trainer(p, p["seed"] + rank, model=ddp(_torch_model(p)))


def _ddp_rank(rank: int, world: int, port: int, p: dict[str, Any], out_dir: str, trainer: Any) -> None:
    """One DDP process: ``trainer(p, rank, DistributedDataParallel)`` gives the loop (``.step()``),
    timed between two barriers after the warm-up; its figures go to ``out_dir/rank<N>.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(p["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = trainer(p, rank, DistributedDataParallel)
        for _ in range(p["warmup"]):
            t.step()
        dist.barrier()
        t0, wall0 = time.perf_counter(), time.time()
        for _ in range(p["steps"]):
            loss = t.step()
        float(loss.detach())
        dist.barrier()
        dt = time.perf_counter() - t0
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"seconds": dt, "steps": p["steps"], "t_a": wall0, "t_b": wall0 + dt, "peak_rss": _peak_rss()}))
    finally:
        dist.destroy_process_group()


def spawn_ddp(p: dict[str, Any], world: int, trainer: Any = _mlp_trainer) -> list[dict[str, Any]]:
    """``world`` DDP processes (gloo, rendezvous on 127.0.0.1 at a free port); each rank's figures."""
    import torch.multiprocessing as mp

    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-ddp-") as d:
        mp.spawn(_ddp_rank, args=(world, port, p, d, trainer), nprocs=world, join=True)
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]


def child_ddp(p: dict[str, Any]) -> dict[str, Any]:
    world = p["world"]
    sampler = LoopbackSampler()
    sampler.start()
    try:
        ranks = spawn_ddp(p, world)
    finally:
        sampler.stop()
    dt = max(r["seconds"] for r in ranks)
    steps = p["steps"]
    out = {"status": "ok", "samples_per_sec": world * steps * p["batch"] / dt, "step_ms": 1e3 * dt / steps,
           "steps": steps, "seconds": dt, "peak_rss": max(r["peak_rss"] for r in ranks)}
    # the loopback's bytes/s between the barriers (all ranks inside their timed window)
    ta, tb = max(r["t_a"] for r in ranks), min(r["t_b"] for r in ranks)
    ba, bb = sampler.at(ta), sampler.at(tb)
    if ba is not None and bb is not None and tb > ta:
        out["lo_bytes_per_sec"] = (bb - ba) / (tb - ta)
    return out


# ------------------------------------------------------------------------------------ dtrain
def _worker_mem(preload: bool = False) -> dict[str, Any]:
    """Runs inside a Dask worker (client.run): its pid, RSS now and peak RSS so far, and the
    top-level packages it has imported (to tell what a run loads beyond the idle baseline)."""
    import gc
    import os
    import resource
    import sys

    import psutil

    fresh_rss = psutil.Process().memory_info().rss
    if preload:  # what every dtrain worker loads anyway: the "idle dtrain worker" baseline
        import torch  # noqa: F401

        import dtrain.ps.shard  # noqa: F401
        import dtrain.worker.replica  # noqa: F401
        import dtrain.worker.tasks  # noqa: F401

        gc.collect()
    status = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile", "RssShmem"):
                    status[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return {"pid": os.getpid(), "rss": psutil.Process().memory_info().rss, "fresh_rss": fresh_rss, "status": status,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "packages": sorted({m.split(".")[0] for m in list(sys.modules) if not m.startswith("_")})}


def dtrain_spec_dict(p: dict[str, Any]) -> dict[str, Any]:
    layers: list[dict[str, Any]] = []
    for h in p["model"]["hidden"]:
        layers += [{"type": "linear", "out": h}, {"type": "relu"}]
    layers.append({"type": "linear", "out": p["model"]["classes"]})
    training: dict[str, Any] = {"mode": p["mode"], "replication": p["replication"],
                                "steps": p["warmup"] + p["steps"], "torch_threads": p["threads"], "seed": p["seed"]}
    if p["mode"] == "async" and p.get("overlap") is not None:
        training["overlap"] = p["overlap"]
    return {
        "name": f"bench-{p['name']}",
        "cluster": {"jobs": {"ps": p["ps"], "worker": p["workers"]}},
        "model": {"input_shape": [p["model"]["input"]], "layers": layers, "loss": "cross_entropy"},
        "placement": {"variables": p["placement"]},
        "data": {"source": "synthetic", "num_samples": p["num_samples"], "num_classes": p["model"]["classes"],
                 "batch_size": p["batch"]},
        "optimizer": p["optimizer"],
        "training": training,
        "summary": {"every_steps": p["every"], "tensorboard": False},
    }


def steady_state(records: list[dict[str, Any]], warmup: int, batch: int, k: int
                 ) -> tuple[float, int, float, float] | None:
    """(samples/s, global steps, t_a, t_b) between the first record at/after the warm-up and the last."""
    recs = sorted((r for r in records if "time" in r and r.get("step") is not None), key=lambda r: r["step"])
    after = [r for r in recs if r["step"] >= warmup]
    if len(after) < 2:
        return None
    a, b = after[0], after[-1]
    dt = b["time"] - a["time"]
    if dt <= 0 or b["step"] <= a["step"]:
        return None
    return (b["step"] - a["step"]) * batch * k / dt, b["step"] - a["step"], a["time"], b["time"]


def child_dtrain(p: dict[str, Any]) -> dict[str, Any]:
    import yaml

    import dtrain
    from dtrain.deploy.cluster import connect

    text = yaml.safe_dump(p.get("spec") or dtrain_spec_dict(p), sort_keys=False)  # spec: a ready one (sparse.py)
    spec = dtrain.loads(text, filename=f"<bench {p['name']}>", base_dir=str(ROOT), overrides=p.get("overrides"))
    plan = dtrain.compile(spec)
    param_bytes = sum(s.bytes for s in plan.shards)
    k = plan.replicas_to_aggregate if spec.training.mode == "sync" else 1
    out: dict[str, Any] = {
        "status": "failed", "param_bytes": param_bytes, "shard_bytes": [s.bytes for s in plan.shards],
        "table_bytes": [s.table_bytes for s in plan.shards],
        "ps_state_bytes": [s.bytes * (1 + optimizer_state_factor(p["optimizer"])) + s.table_bytes
                           for s in plan.shards],
        "optimizer_state_bytes": param_bytes * optimizer_state_factor(p["optimizer"]),
        "replicas": plan.num_replicas, "samples_per_global_step": k * p["batch"],
        # per global step: k gradient pushes and k parameter replies of every shard, fp32
        "bytes_per_step_protocol": 2 * k * param_bytes,
    }
    run_dir = Path(p["run_dir"])
    sampler = LoopbackSampler()
    phases: dict[str, float] = {"child_start": round(time.time() - p["t_launch"], 2)}
    t0 = time.time()
    with connect(spec) as conn:
        phases["cluster_start"] = round(time.time() - t0, 2)
        client = conn.client
        names = {addr: str(info.get("name")) for addr, info in conn.workers().items()}
        t0 = time.time()
        idle = {names.get(a, a): v for a, v in client.run(_worker_mem, True).items()}
        phases["worker_preload"] = round(time.time() - t0, 2)
        # The chief: this process (the session, and the embedded scheduler and nannies).
        sampler.pids = {**{n: v["pid"] for n, v in idle.items()}, "chief": os.getpid()}
        sampler.start()
        t0 = time.time()
        try:
            result = dtrain.run(spec, client=client, run_dir=run_dir)
            summary = result.summary
        except Exception as exc:  # reported, not raised: in_graph may not exist yet
            out["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
            summary = read_json(run_dir / "summary.json")
        finally:
            sampler.stop()
            phases["dtrain_run"] = round(time.time() - t0, 2)
        with contextlib.suppress(Exception):
            after = {names.get(a, a): v for a, v in client.run(_worker_mem).items()}
            out["memory"] = {n: {"fresh_rss": idle[n]["fresh_rss"], "idle_rss": idle[n]["rss"],
                                 "idle_peak_rss": idle[n]["peak_rss"],
                                 "peak_rss": after[n]["peak_rss"], "end_rss": after[n]["rss"],
                                 "idle_status": idle[n]["status"], "end_status": after[n]["status"],
                                 "pid": after[n]["pid"],
                                 "packages_loaded_by_run": sorted(set(after[n]["packages"]) - set(idle[n]["packages"]))}
                             for n in after if n in idle}
        t0 = time.time()
    phases["cluster_close"] = round(time.time() - t0, 2)
    out["phases_s"] = phases
    out["summary"] = summary
    if summary is None or summary.get("status") != "completed":
        out.setdefault("error", (summary or {}).get("error", "run did not complete"))
        return out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ss = steady_state(records, p["warmup"], p["batch"], k)
    out["summary_samples_per_sec"] = summary.get("samples_per_sec")
    if ss is not None:
        sps, steps, ta, tb = ss
        out.update(method="metrics.jsonl", samples_per_sec=sps, timed_global_steps=steps, seconds=tb - ta)
        ba, bb = sampler.at(ta), sampler.at(tb)
        if ba is not None and bb is not None and steps:
            out["lo_bytes_per_step_window"] = (bb - ba) / steps
            out["lo_bytes_per_sec_window"] = (bb - ba) / (tb - ta)
        # The loopback counter is machine-wide: other processes' traffic adds to it in bursts, so
        # the median over the summary intervals is used (robust to a few contaminated intervals).
        per = []
        after = sorted((r for r in records if "time" in r and r.get("step", -1) >= p["warmup"]),
                       key=lambda r: r["step"])
        for a, b in zip(after, after[1:], strict=False):
            la, lb = sampler.at(a["time"]), sampler.at(b["time"])
            if la is not None and lb is not None and b["step"] > a["step"]:
                per.append((lb - la) / (b["step"] - a["step"]))
        if per:
            out["lo_bytes_per_step"] = statistics.median(per)
            out["lo_bytes_per_sec"] = out["lo_bytes_per_step"] * steps / (tb - ta)  # at the run's step rate
        # CPU in the timed window, in ms: per step of one replica (a replica takes k / replicas of
        # its own steps per global step) and per push (k applied gradients per global step: with
        # R replicas a ps serves R pushes while one replica takes a step).
        cpu = sampler.cpu_between(ta, tb)
        if cpu and steps:
            own = plan.num_replicas / k
            out["cpu_ms_per_global_step"] = {n: 1e3 * c / steps for n, c in cpu.items()}
            out["cpu_ms_per_replica_step"] = {n: 1e3 * c / steps * own for n, c in cpu.items()}
            out["cpu_ms_per_push"] = {n: 1e3 * c / (steps * k) for n, c in cpu.items()}
    else:
        out.update(method="summary", samples_per_sec=summary.get("samples_per_sec"))
    if out.get("samples_per_sec"):
        out["step_ms"] = 1e3 * plan.num_replicas * p["batch"] / out["samples_per_sec"]
    out["status"] = "ok"
    return out


# ------------------------------------------------------------------------------------ dispatch
def run_child(kind: str, params: str, result: str) -> int:
    """The child's side of ``bench.py --child KIND --params JSON --result PATH``."""
    p = json.loads(params)
    from .sparse import child_sparse_ddp, child_sparse_plain

    fn = {"plain": child_plain, "ddp": child_ddp, "dtrain": child_dtrain, "sparse_plain": child_sparse_plain,
          "sparse_ddp": child_sparse_ddp}.get(kind)
    if kind == "echo":
        child_echo(p)
        return 0
    if fn is None:
        print(f"unknown child {kind}", file=sys.stderr)
        return 2
    try:
        res = fn(p)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        res = {"status": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
    Path(result).write_text(json.dumps(res, default=str))
    return 0
