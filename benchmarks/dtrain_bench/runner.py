"""The parent's side of a measurement: start each child in its own process group, time it out,
kill what it leaves behind, and run one configuration for one repetition."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .configs import ENTRY, ROOT, Config, optimizer_for, progress, read_json


class Runner:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.count = 0
        self._lock = threading.Lock()

    def base_params(self, model: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        return {"model": model, "batch": a.batch, "threads": a.threads, "seed": 0,
                "optimizer": optimizer_for(a.optimizer, a.lr), "num_samples": a.num_samples}

    def child(self, kind: str, params: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Run one measurement in a fresh subprocess (own process group); never raises."""
        with self._lock:
            self.count += 1
            tag = f"{self.count:03d}-{kind}-{params.get('name', '')}"
        result_path = self.workdir / f"{tag}.json"
        log_path = self.workdir / f"{tag}.log"
        env = dict(os.environ, OMP_NUM_THREADS=str(self.args.threads), MKL_NUM_THREADS=str(self.args.threads),
                   DASK_LOGGING__DISTRIBUTED="warning", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        params = {**params, "t_launch": time.time()}
        cmd = [sys.executable, str(ENTRY), "--child", kind, "--params", json.dumps(params),
               "--result", str(result_path)]
        timeout = timeout or self.args.timeout
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return {"status": "failed", "error": f"timed out after {timeout:.0f} s", "log_tail": _tail(log_path)}
            except BaseException:
                _kill_group(proc)
                raise
        strays = _group_alive(proc.pid, grace=2.0)
        _kill_group(proc)  # anything the child left behind in its group (it should leave nothing)
        res = read_json(result_path)
        if res is None:
            return {"status": "failed", "error": f"child exited {rc} without a result", "log_tail": _tail(log_path)}
        if res.get("status") != "ok" and "log_tail" not in res:
            res["log_tail"] = _tail(log_path)
        if strays:
            res["stray_processes"] = True  # the child exited but left processes behind (killed now)
            progress(f"  note: {tag} left processes behind after it exited; they were killed")
        return res

    # ----------------------------------------------------------------- one config, one rep
    def measure(self, cfg: Config, model: dict[str, Any], rep: int, warmup: int, steps: int,
                every: int) -> dict[str, Any]:
        a = self.args
        p = {**self.base_params(model), "name": cfg.name, "rep": rep}
        if cfg.kind == "plain":
            return self.child("plain", {**p, "warmup": a.plain_warmup, "steps": steps,
                                        "min_seconds": a.min_seconds})
        if cfg.kind == "plain_x2":
            return self.plain_pair(p, steps)
        if cfg.kind == "ddp":
            return self.child("ddp", {**p, "world": cfg.workers, "warmup": a.plain_warmup, "steps": steps})
        run_dir = self.workdir / f"run-{cfg.name}-rep{rep}-{self.count + 1}"
        res = self.child("dtrain", {**p, "mode": cfg.mode, "replication": cfg.replication, "overlap": cfg.overlap,
                                    "ps": cfg.ps, "workers": cfg.workers, "placement": cfg.placement,
                                    "warmup": warmup, "steps": steps, "every": every, "run_dir": str(run_dir),
                                    "overrides": [*cfg.sets, *a.set] or None})
        if not a.keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        return res

    def plain_pair(self, p: dict[str, Any], steps: int) -> dict[str, Any]:
        results: list[dict[str, Any]] = [{}, {}]

        def go(i: int) -> None:
            results[i] = self.child("plain", {**p, "instance": i, "warmup": self.args.plain_warmup, "steps": steps,
                                              "min_seconds": self.args.min_seconds})

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(r.get("status") != "ok" for r in results):
            bad = next(r for r in results if r.get("status") != "ok")
            return {"status": "failed", "error": bad.get("error"), "log_tail": bad.get("log_tail")}
        return {"status": "ok", "samples_per_sec": sum(r["samples_per_sec"] for r in results),
                "step_ms": statistics.mean(r["step_ms"] for r in results), "per_process": results}


def _group_alive(pgid: int, grace: float) -> bool:
    """Whether any process of the group still runs ``grace`` seconds after its leader exited."""
    import psutil

    def alive() -> bool:
        for proc in psutil.process_iter(["status"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
        return False

    deadline = time.monotonic() + grace
    while alive():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)
    return False


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""

