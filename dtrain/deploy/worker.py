"""``dtrain worker``: a Dask worker serving one task (name ``JOB-N``, resource ``JOB=1``).

It checks its arguments (exit 2, nothing started), checks that the scheduler answers (exit 1
when it cannot be reached within ``--wait-s`` or refuses this worker's TLS certificate), then
execs ``python -m dtrain.deploy.dask_worker`` (``dask worker`` with dtrain's Dask settings; same
pid), so a process manager's signals reach Dask directly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

EXIT_FAILED, EXIT_USAGE = 1, 2


class _Stop(Exception):
    """Leave ``main`` with ``code`` after printing ``message`` on stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _usage(message: str) -> _Stop:
    return _Stop(EXIT_USAGE, f"dtrain worker: {message}")


def add_arguments(w: argparse.ArgumentParser) -> None:
    w.add_argument("--job", required=True, help="job name, e.g. ps or worker")
    w.add_argument("--task", required=True, type=int, help="task index within the job (0, 1, ...)")
    where = w.add_mutually_exclusive_group(required=True)
    where.add_argument("--scheduler", help="scheduler address, e.g. tcp://10.0.0.5:8786 or tls://10.0.0.5:8786")
    where.add_argument("--scheduler-file", help="JSON file written by `dask scheduler --scheduler-file` "
                                                "(on a shared file system)")
    w.add_argument("--host", default=None, help="interface to listen on (default: Dask's choice)")
    w.add_argument("--nthreads", type=int, default=2, help="threads of this worker (a replica uses one)")
    w.add_argument("--memory-limit", default="auto", help="e.g. 4GiB; default: the machine's memory / workers")
    w.add_argument("--resources", action="append", default=[], metavar="NAME=N",
                   help="extra Dask resources besides JOB=1, e.g. GPU=1 (repeatable, or comma-separated)")
    w.add_argument("--no-nanny", action="store_true", help="run the worker without a nanny process")
    w.add_argument("--worker-port", help="fixed port of the worker (default: random), e.g. for firewalls")
    w.add_argument("--nanny-port", help="fixed port of the nanny (default: random)")
    w.add_argument("--wait-s", type=float, default=60.0,
                   help="check that the scheduler answers before starting, for up to this many seconds; "
                        "exit 1 if it does not (0: skip the check and let Dask retry forever)")
    w.add_argument("--tls-ca-file", help="CA certificate (PEM); with --tls-cert: encrypted, authenticated "
                                         "connections only (the scheduler address must be tls://)")
    w.add_argument("--tls-cert", help="this worker's certificate (PEM), signed by the CA")
    w.add_argument("--tls-key", help="this worker's private key (PEM), unless --tls-cert holds it")
    w.add_argument("--device", help="cpu, cuda:N or /gpu:N: sets CUDA_VISIBLE_DEVICES for this worker")
    w.add_argument("dask_args", nargs="*", metavar="-- DASK_WORKER_ARGS",
                   help="further `dask worker` options after `--`, e.g. -- --lifetime 12h")


def main(args: argparse.Namespace) -> int:
    """Check, probe, exec (see the module docstring); returns an exit code only when it fails."""
    try:
        name = _check_task(args)
        resources = _resources(args)
        tls = _tls_files(args)
        env = _environment(args)
        address = _address(args, bool(tls))
        _warn_all_interfaces(args, bool(tls))
        if args.wait_s > 0:
            address = _probe(args, address, bool(tls))
    except _Stop as stop:
        print(str(stop), file=sys.stderr)
        return stop.code
    cmd = _dask_worker_command(args, name, address, resources, tls)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return EXIT_FAILED  # pragma: no cover - exec does not return


def _warn_all_interfaces(args: argparse.Namespace, use_tls: bool) -> None:
    """Without ``--host`` Dask listens on every interface (0.0.0.0): say so, louder without TLS,
    where anyone who reaches the port can run code as this user (docs/security.md)."""
    if args.host is not None or any(a.startswith(("--listen-address", "--host")) for a in args.dask_args):
        return
    risk = ("connections are TLS-authenticated" if use_tls else
            "without TLS anyone who reaches its port can run code as this user")
    print(f"dtrain worker: warning: no --host given, so this worker listens on every network interface "
          f"({risk}); pass --host with the interface the scheduler and the other workers reach, "
          f"e.g. --host 127.0.0.1 or --host \"$(hostname -i)\"", file=sys.stderr)


def _check_task(args: argparse.Namespace) -> str:
    from dtrain.spec.device import JOB_NAME_RULE

    if not re.fullmatch(JOB_NAME_RULE, args.job):  # the rule cluster.jobs and device strings follow
        raise _usage(f"--job {args.job!r}: a job name must match {JOB_NAME_RULE} (a letter, then letters, digits "
                     "or '_'), as TensorFlow's servers require")
    if args.task < 0:
        raise _usage(f"--task {args.task}: task indices start at 0")
    if args.nthreads < 1:
        raise _usage(f"--nthreads {args.nthreads}: at least 1")
    return f"{args.job}-{args.task}"


def _resources(args: argparse.Namespace) -> dict[str, str]:
    resources = {args.job: "1"}
    for item in ",".join(args.resources).replace(",", " ").split():
        key, sep, value = item.partition("=")
        try:
            ok = bool(sep and key) and float(value) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise _usage(f"--resources {item!r}: expected NAME=NUMBER, e.g. GPU=1")
        if key == args.job:
            raise _usage(f"--resources {item!r}: the resource {args.job}=1 is set by --job already")
        resources[key] = value
    return resources


def _tls_files(args: argparse.Namespace) -> dict[str, str]:
    """The ``--tls-*`` flags given (none: a plain tcp:// worker)."""
    tls = {flag: value for flag, value in (("--tls-ca-file", args.tls_ca_file), ("--tls-cert", args.tls_cert),
                                           ("--tls-key", args.tls_key)) if value}
    if tls:
        if not (args.tls_ca_file and args.tls_cert):
            raise _usage("TLS needs --tls-ca-file and --tls-cert (and --tls-key unless the certificate file "
                         "holds the key)")
        for flag, value in tls.items():
            if not (os.path.isfile(value) and os.access(value, os.R_OK)):
                raise _usage(f"{flag} {value}: no such readable file")
    return tls


def _environment(args: argparse.Namespace) -> dict[str, str]:
    from dtrain.deploy.env import MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD

    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    # Keep torch's per-step buffers on the heap (see dtrain.deploy.cluster.dask_config): for this
    # process itself when it runs without a nanny (dtrain.deploy.dask_worker sets them for a
    # nanny's worker).
    for var, value in (("MALLOC_TRIM_THRESHOLD_", MALLOC_TRIM_THRESHOLD),
                       ("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)):
        env.setdefault(var, str(value))
    if args.device:
        device = args.device.strip().lower().lstrip("/").removeprefix("device:")
        kind, _, index = device.partition(":")
        if kind == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif kind in ("cuda", "gpu") and (index == "" or index.isdigit()):
            if index:
                env["CUDA_VISIBLE_DEVICES"] = index
        else:
            raise _usage(f"--device {args.device!r}: expected cpu, cuda, cuda:N or /gpu:N")
    return env


def _scheme_problem(address: str, use_tls: bool) -> str | None:
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if scheme == "tls" and not use_tls:
        return (f"the scheduler at {address} uses TLS: pass --tls-ca-file, --tls-cert and --tls-key "
                f"(see docs/deployment.md)")
    if use_tls and scheme != "tls":
        return (f"--tls-* files given, so every connection must be encrypted, but the scheduler address "
                f"{address} is {scheme}://; use tls://")
    return None


def _address(args: argparse.Namespace, use_tls: bool) -> str | None:
    """``--scheduler`` checked against the TLS flags (None with ``--scheduler-file``)."""
    address = args.scheduler
    if address is None:
        return None
    if use_tls and "://" not in address:
        address = f"tls://{address}"
    problem = _scheme_problem(address, use_tls)
    if problem:
        raise _usage(problem)
    return address


def _read_scheduler_file(args: argparse.Namespace, deadline: float, use_tls: bool) -> str:
    """Wait for ``dask scheduler --scheduler-file`` to write the address, as Dask would."""
    while True:
        try:
            address = str(json.loads(Path(args.scheduler_file).read_text())["address"])
            break
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if time.monotonic() >= deadline:
                raise _Stop(EXIT_FAILED, f"dtrain worker: no scheduler address in {args.scheduler_file} after "
                                         f"{args.wait_s:g} s (--wait-s): {exc}") from None
            time.sleep(0.2)
    problem = _scheme_problem(address, use_tls)
    if problem:
        raise _usage(f"{args.scheduler_file}: {problem}")
    return address


def _probe(args: argparse.Namespace, address: str | None, use_tls: bool) -> str:
    """Connect to the scheduler once (within ``--wait-s``), as this worker would; returns its address."""
    import asyncio

    from distributed.comm import connect as comm_connect
    from distributed.comm.core import FatalCommClosedError
    from distributed.security import Security

    deadline = time.monotonic() + args.wait_s
    if args.scheduler_file:
        address = _read_scheduler_file(args, deadline, use_tls)
    assert address is not None
    sec = (Security(tls_ca_file=args.tls_ca_file, tls_worker_cert=args.tls_cert, tls_worker_key=args.tls_key,
                    require_encryption=True) if use_tls else Security())

    async def probe() -> None:
        comm = await comm_connect(address, timeout=max(deadline - time.monotonic(), 1.0),
                                  **sec.get_connection_args("worker"))
        await comm.close()

    try:
        asyncio.run(probe())
    except FatalCommClosedError as exc:  # a failed TLS handshake: retrying cannot help
        raise _Stop(EXIT_FAILED, f"dtrain worker: the scheduler at {address} refused the TLS connection ({exc}); "
                                 f"is {args.tls_cert} signed by the CA the scheduler trusts, and {args.tls_ca_file} "
                                 f"the CA that signed the scheduler's certificate?") from None
    except ValueError as exc:  # a malformed address
        raise _usage(f"--scheduler {address}: {exc}") from None
    except Exception as exc:
        hint = " (if the scheduler uses TLS, give its tls:// address and --tls-* files)" if not use_tls else ""
        raise _Stop(EXIT_FAILED, f"dtrain worker: cannot reach the scheduler at {address} within {args.wait_s:g} s "
                                 f"(--wait-s): {exc}{hint}. Is `dask scheduler` running there, and its port open "
                                 f"to this machine?") from None
    return address


def _listen_host(args: argparse.Namespace) -> str | None:
    """The host this worker listens on: ``--host``, or the host of a ``--listen-address`` among the
    `dask worker` options; None when neither names one (Dask's choice: every interface)."""
    if args.host:
        return str(args.host)
    for i, a in enumerate(args.dask_args):
        if a.startswith("--listen-address"):
            value = a.partition("=")[2] or (args.dask_args[i + 1] if i + 1 < len(args.dask_args) else "")
            host = urlsplit(value if "://" in value else f"tcp://{value}").hostname
            return host or None
    return None


def _dask_worker_command(args: argparse.Namespace, name: str, address: str | None, resources: dict[str, str],
                         tls: dict[str, str]) -> list[str]:
    cmd: list[Any] = [sys.executable, "-m", "dtrain.deploy.dask_worker"]
    cmd += ["--scheduler-file", args.scheduler_file] if args.scheduler_file else [str(address)]
    cmd += ["--name", name, "--resources", ",".join(f"{k}={v}" for k, v in resources.items()),
            "--nthreads", str(args.nthreads), "--memory-limit", args.memory_limit, "--no-dashboard"]
    for flag, value in (("--host", args.host), ("--worker-port", args.worker_port),
                        ("--nanny-port", args.nanny_port)):
        if value:
            cmd += [flag, value]
    host = _listen_host(args)
    if host and not any(a.startswith("--dashboard-address") for a in args.dask_args):
        # The worker's HTTP server (/metrics, /health) runs even with --no-dashboard, on every
        # interface unless told: on the host this worker listens on.
        cmd += ["--dashboard-address", f"[{host}]:0" if ":" in host else f"{host}:0"]
    if args.no_nanny:
        cmd += ["--no-nanny"]
    for flag, value in tls.items():
        cmd += [flag, value]
    return cmd + list(args.dask_args)
