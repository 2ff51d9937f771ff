"""The ps's part of a sync step, alone: N replicas (threads of this process, each with its own
shared-memory connection) push a gradient of the benchmark MLP's size at the same step, with no
compute between steps, so a step's time is the ps's critical path: the quorum's sum and apply,
then each replica's reply. With snapshots (``share_params`` off, as before) every reply copies the
shard into that replica's slot, one after the other under the shard's lock; read in place (the
default in sync without backup replicas, dataplane/shm.py ``SharedParams``) no reply copies.

    python benchmarks/sync_step.py                 # N = 2, 4, 8; 300 steps each, both ways, 3 rounds
    python benchmarks/sync_step.py --replicas 2 --steps 50 --rounds 1

Prints the median milliseconds per step and the ratio; real ParameterShard, ShardServer and
SocketShard, on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.dataplane.client import SocketShard  # noqa: E402
from dtrain.dataplane.server import ShardServer  # noqa: E402
from dtrain.ps.shard import ParameterShard  # noqa: E402

NUMEL = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10  # the benchmark MLP: 669,706 floats
SECRET = b"b" * 32


def one_run(replicas: int, steps: int, in_place: bool, numel: int = NUMEL) -> float:
    """Milliseconds per sync step, the mean over the timed steps."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = {"index": 0, "mode": "sync", "steps": 10**9, "num_replicas": replicas, "telemetry": False,
              "optimizer": {"name": "sgd", "lr": 1e-6}, "barrier_timeout_s": 60}
    shard = ParameterShard(config, torch.zeros(numel))
    server = ShardServer(shard, loop, SECRET, share_params=in_place)
    clients = [SocketShard(server.host, server.port, SECRET, replica=r, numel=numel, timeout=60)
               for r in range(replicas)]
    try:
        grads = [c.grad_slots()[0] for c in clients]
        for g in grads:
            g.fill_(1.0)
        warm = 20
        times: list[float] = []
        barrier = threading.Barrier(replicas)

        def replica(r: int) -> None:
            for k in range(warm + steps):
                if r == 0:
                    times.append(time.perf_counter())
                barrier.wait()
                clients[r].push_sync(grads[r], r, k).result(timeout=60)
            if r == 0:
                times.append(time.perf_counter())

        workers = [threading.Thread(target=replica, args=(r,)) for r in range(replicas)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if (server.in_place_connections == replicas) != in_place:  # (counted once the ps read the answer)
            raise SystemExit(f"expected in_place={in_place}, got {server.in_place_connections} of {replicas}")
        return 1000 * (times[-1] - times[warm]) / steps
    finally:
        for c in clients:
            c.close()
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of both ways")
    args = ap.parse_args(argv)
    if not os.path.isdir("/dev/shm"):
        print("sync_step.py: needs /dev/shm (shared memory) on this machine", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"ps part of a sync step, {NUMEL:,} floats, {args.steps} steps x {args.rounds} rounds (ms per step, median)")
    print(f"{'replicas':>8}  {'snapshots':>9}  {'in place':>8}  {'ratio':>5}")
    for n in args.replicas:
        copy, shared = [], []
        for _ in range(args.rounds):
            copy.append(one_run(n, args.steps, False))
            shared.append(one_run(n, args.steps, True))
        a, b = statistics.median(copy), statistics.median(shared)
        print(f"{n:>8}  {a:>9.3f}  {b:>8.3f}  {a / b:>5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
