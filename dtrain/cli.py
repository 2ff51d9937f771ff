"""The ``dtrain`` command: run, validate, plan, schema, worker.

Exit codes (DESIGN.md): 0 success; 2 invalid pipeline or usage (nothing started, nothing
written); 1 a run that failed; 130 on SIGINT and 143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .spec.errors import RunDirError, RunError, SpecError, Terminated

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143

logger = logging.getLogger("dtrain")


class _Usage(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep its one-line style
        self.print_usage(sys.stderr)
        print(f"dtrain: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Usage(prog="dtrain", description="Parameter-server training for PyTorch on Dask, from a YAML pipeline.")
    p.add_argument("--version", action="version", version=f"dtrain {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Usage)

    r = sub.add_parser("run", help="run a pipeline (on an embedded local cluster unless --scheduler is given)")
    r.add_argument("pipeline", help="pipeline YAML file")
    r.add_argument("--run-dir", help="run directory (default: runs/<name>/)")
    r.add_argument("--scheduler", help="address of a running Dask scheduler, e.g. tcp://10.0.0.5:8786")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pipeline value, e.g. --set training.steps=50 (repeatable)")
    r.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run directory")
    r.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")

    v = sub.add_parser("validate", help="check a pipeline file; one FILE:LINE: path: message line per problem")
    v.add_argument("pipeline", nargs="+")

    pl = sub.add_parser("plan", help="print where every variable, layer, op and replica is placed")
    pl.add_argument("pipeline")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    sub.add_parser("schema", help="print the JSON Schema of pipeline files (for editors' YAML completion)")

    rp = sub.add_parser("report", help="plot a run's loss and eval curves to a PNG and print a short table")
    rp.add_argument("run_dir")
    rp.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")

    w = sub.add_parser(
        "worker", help="start a Dask worker serving one task (name JOB-N, resource JOB=1)",
        description="Start a Dask worker for task N of job JOB: the equivalent of `dask worker ADDR --name JOB-N "
        "--resources JOB=1` (see docs/deployment.md). Arguments after `--` go to `dask worker` unchanged.")
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
    return p


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"run": cmd_run, "validate": cmd_validate, "plan": cmd_plan, "schema": cmd_schema,
               "worker": cmd_worker, "report": cmd_report}[args.command]
    try:
        code = handler(args)
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        code = EXIT_USAGE
    except RunDirError as exc:
        print(f"dtrain: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except RunError as exc:
        print(f"dtrain: run failed: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    return code


def cmd_validate(args: argparse.Namespace) -> int:
    from .spec.loading import load

    code = EXIT_OK
    for path in args.pipeline:
        try:
            load(path)
            print(f"{path}: ok")
        except SpecError as exc:
            print(str(exc), file=sys.stderr)
            code = EXIT_USAGE
    return code


def cmd_schema(args: argparse.Namespace) -> int:
    from .spec.pipeline import PipelineSpec

    schema = PipelineSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "dtrain pipeline"
    print(json.dumps(schema, indent=2))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from .chief.report import render

    try:
        png, table = render(Path(args.run_dir), Path(args.out) if args.out else None)
    except (ValueError, OSError) as exc:
        print(f"dtrain: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(table)
    print(f"plot: {png}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan.compiler import compile
    from .spec.loading import load

    plan = compile(load(args.pipeline, overrides=args.overrides))
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.format())
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from .spec.loading import load

    spec = load(args.pipeline, overrides=args.overrides)
    _setup_logging(quiet=args.quiet)
    from .chief.session import check_run_dir, default_run_dir, run

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(spec)
    check_run_dir(run_dir, args.resume)

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    bar = _Progress(enabled=not args.quiet)
    try:
        result = run(spec, run_dir=run_dir, scheduler=args.scheduler, resume=args.resume, progress=bar.update)
    except Terminated:
        bar.close()
        print("dtrain: terminated (SIGTERM); checkpoint written where configured", file=sys.stderr)
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        bar.close()
        print("dtrain: interrupted (SIGINT); checkpoint written where configured", file=sys.stderr)
        return EXIT_SIGINT
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, old)
    s = result.summary
    if result.fetched:
        for name, value in result.fetched.items():
            print(f"{name} = {value}")
        return EXIT_OK
    ev = s.get("eval") or {}
    acc = f"  accuracy {ev['accuracy']:.4f}" if ev.get("accuracy") is not None else ""
    evl = f"  eval loss {ev['loss']:.4f}" if ev.get("loss") is not None else ""
    loss = f"  loss {s['final_loss']:.4f}" if s.get("final_loss") is not None else ""
    print(f"{s['name']}: {s['status']} at step {s['global_step']}{loss}{evl}{acc}  "
          f"samples/s {s.get('samples_per_sec') or 0:.0f}  ({s['wall_s']:.1f} s)  -> {result.run_dir}")
    return EXIT_OK


class _Progress:
    """A live progress bar on stderr (rich): step, loss, samples/s."""

    def __init__(self, enabled: bool):
        self._p = None
        self._task = None
        self.enabled = enabled

    def update(self, info: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._p is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                               console=Console(stderr=True), transient=False)
            self._p.start()
            self._task = self._p.add_task("train", total=info["steps"], info="")
        parts = []
        if info.get("loss") is not None:
            parts.append(f"loss {info['loss']:.4f}")
        if info.get("samples_per_sec"):
            parts.append(f"{info['samples_per_sec']:.0f} samples/s")
        if info.get("dropped_stale"):
            parts.append(f"stale {info['dropped_stale']}")
        self._p.update(self._task, completed=min(info["step"], info["steps"]), info="  ".join(parts))

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def _setup_logging(quiet: bool = False) -> None:
    import distributed  # noqa: F401 - it configures its loggers on import: import first, then quiet them

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("dtrain").setLevel(logging.WARNING if quiet else logging.INFO)
    # Dask logs comm retries and worker shutdowns at INFO/WARNING; a run's own messages matter more.
    for name in ("distributed", "tornado", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in list(logging.root.manager.loggerDict):  # Dask sets levels on its child loggers too
        if name.startswith(("distributed.", "tornado.")):
            logging.getLogger(name).setLevel(logging.ERROR)


def cmd_worker(args: argparse.Namespace) -> int:
    """`dtrain worker`: check the arguments and that the scheduler answers, then become `dask worker`.

    The process execs ``python -m dtrain.deploy.dask_worker`` (``dask worker`` with dtrain's Dask
    settings; same pid), so a process manager's
    signals reach Dask directly. Exit 2 for bad arguments (nothing started); exit 1 when the scheduler
    cannot be reached within ``--wait-s`` or refuses this worker's TLS certificate.
    """
    import re

    def usage(message: str) -> int:
        print(f"dtrain worker: {message}", file=sys.stderr)
        return EXIT_USAGE

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", args.job):
        return usage(f"--job {args.job!r}: a job name is letters, digits, '_', '.', '-'")
    if args.task < 0:
        return usage(f"--task {args.task}: task indices start at 0")
    if args.nthreads < 1:
        return usage(f"--nthreads {args.nthreads}: at least 1")
    name = f"{args.job}-{args.task}"

    resources = {args.job: "1"}
    for item in ",".join(args.resources).replace(",", " ").split():
        key, sep, value = item.partition("=")
        try:
            ok = bool(sep and key) and float(value) >= 0
        except ValueError:
            ok = False
        if not ok:
            return usage(f"--resources {item!r}: expected NAME=NUMBER, e.g. GPU=1")
        if key == args.job:
            return usage(f"--resources {item!r}: the resource {args.job}=1 is set by --job already")
        resources[key] = value

    tls = {"--tls-ca-file": args.tls_ca_file, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    use_tls = any(tls.values())
    if use_tls:
        if not (args.tls_ca_file and args.tls_cert):
            return usage("TLS needs --tls-ca-file and --tls-cert (and --tls-key unless the certificate file "
                         "holds the key)")
        for flag, value in tls.items():
            if value and not (os.path.isfile(value) and os.access(value, os.R_OK)):
                return usage(f"{flag} {value}: no such readable file")

    from .deploy.cluster import MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD

    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    # Keep torch's per-step buffers on the heap (see dtrain.deploy.cluster.dask_config): for this process
    # itself when it runs without a nanny (dtrain.deploy.dask_worker sets them for a nanny's worker).
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
            return usage(f"--device {args.device!r}: expected cpu, cuda, cuda:N or /gpu:N")

    def check_scheme(address: str) -> str | None:
        scheme = address.split("://", 1)[0] if "://" in address else "tcp"
        if scheme == "tls" and not use_tls:
            return (f"the scheduler at {address} uses TLS: pass --tls-ca-file, --tls-cert and --tls-key "
                    f"(see docs/deployment.md)")
        if use_tls and scheme != "tls":
            return (f"--tls-* files given, so every connection must be encrypted, but the scheduler address "
                    f"{address} is {scheme}://; use tls://")
        return None

    address = args.scheduler
    if address is not None:
        if use_tls and "://" not in address:
            address = f"tls://{address}"
        problem = check_scheme(address)
        if problem:
            return usage(problem)

    if args.wait_s > 0:
        import asyncio
        import time

        from distributed.comm import connect as comm_connect
        from distributed.comm.core import FatalCommClosedError
        from distributed.security import Security

        deadline = time.monotonic() + args.wait_s
        if args.scheduler_file:  # wait for `dask scheduler --scheduler-file` to write it, as Dask would
            while True:
                try:
                    address = str(json.loads(Path(args.scheduler_file).read_text())["address"])
                    break
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    if time.monotonic() >= deadline:
                        print(f"dtrain worker: no scheduler address in {args.scheduler_file} after "
                              f"{args.wait_s:g} s (--wait-s): {exc}", file=sys.stderr)
                        return EXIT_FAILED
                    time.sleep(0.2)
            problem = check_scheme(address)
            if problem:
                return usage(f"{args.scheduler_file}: {problem}")
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
            print(f"dtrain worker: the scheduler at {address} refused the TLS connection ({exc}); is "
                  f"{args.tls_cert} signed by the CA the scheduler trusts, and {args.tls_ca_file} the CA that "
                  f"signed the scheduler's certificate?", file=sys.stderr)
            return EXIT_FAILED
        except ValueError as exc:  # a malformed address
            return usage(f"--scheduler {address}: {exc}")
        except Exception as exc:
            hint = (" (if the scheduler uses TLS, give its tls:// address and --tls-* files)"
                    if not use_tls else "")
            print(f"dtrain worker: cannot reach the scheduler at {address} within {args.wait_s:g} s "
                  f"(--wait-s): {exc}{hint}. Is `dask scheduler` running there, and its port open to this "
                  f"machine?", file=sys.stderr)
            return EXIT_FAILED

    cmd = [sys.executable, "-m", "dtrain.deploy.dask_worker"]
    cmd += ["--scheduler-file", args.scheduler_file] if args.scheduler_file else [str(address)]
    cmd += ["--name", name, "--resources", ",".join(f"{k}={v}" for k, v in resources.items()),
            "--nthreads", str(args.nthreads), "--memory-limit", args.memory_limit, "--no-dashboard"]
    if args.host:
        cmd += ["--host", args.host]
    if args.no_nanny:
        cmd += ["--no-nanny"]
    if args.worker_port:
        cmd += ["--worker-port", args.worker_port]
    if args.nanny_port:
        cmd += ["--nanny-port", args.nanny_port]
    for flag, value in tls.items():
        if value:
            cmd += [flag, value]
    cmd += list(args.dask_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return EXIT_FAILED  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
