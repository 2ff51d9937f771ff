"""The ``dtrain`` command: run, validate, plan, schema, worker.

Exit codes (docs/cli.md): 0 success; 2 invalid pipeline or usage (nothing started, nothing
written); 1 a run that failed; 130 on SIGINT and 143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import RunDirError, RunError, Terminated
from .spec.errors import SpecError

if TYPE_CHECKING:  # rich is imported when the bar first shows
    from rich.progress import Progress, TaskID

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143

logger = logging.getLogger("dtrain")


class _Usage(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 already; keep its one-line style
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
    r.add_argument("--profile-startup", action="store_true",
                   help="print where the run's fixed costs go: each phase's seconds, start to exit")

    v = sub.add_parser("validate", help="check a pipeline file; one FILE:LINE: path: message line per problem")
    v.add_argument("pipeline", nargs="+")

    pl = sub.add_parser("plan", help="print where every variable, layer, op and replica is placed")
    pl.add_argument("pipeline")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--scheduler", help="a running Dask scheduler: show which of its workers would serve each task "
                    "(named, or assigned automatically: cluster.assign); starts nothing there")

    sub.add_parser("schema", help="print the JSON Schema of pipeline files (for editors' YAML completion)")

    rp = sub.add_parser("report", help="plot a run's loss and eval curves to a PNG and print a short table")
    rp.add_argument("run_dir")
    rp.add_argument("--out", help="PNG path (default: RUN_DIR/report.png)")

    ex = sub.add_parser("export", help="write a run's checkpoint as a model for serving (no optimizer state)",
                        description="Write the newest checkpoint of RUN_DIR (or --step N's) into OUT: model.pt "
                        "(the dense parameters), each table as a memory-mappable .npy, and export.json; "
                        "dtrain.serving.ExportedModel(OUT) serves lookups and predictions from it.")
    ex.add_argument("run_dir")
    ex.add_argument("out", help="a new (or empty) directory")
    ex.add_argument("--step", type=int, help="the checkpoint of this global step (default: the newest)")

    w = sub.add_parser(
        "worker", help="start a Dask worker serving one task (name JOB-N, resource JOB=1)",
        description="Start a Dask worker for task N of job JOB: the equivalent of `dask worker ADDR --name JOB-N "
        "--resources JOB=1` (see docs/deployment.md). Arguments after `--` go to `dask worker` unchanged.")
    from .deploy.worker import add_arguments

    add_arguments(w)
    return p


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"run": cmd_run, "validate": cmd_validate, "plan": cmd_plan, "schema": cmd_schema,
               "worker": cmd_worker, "report": cmd_report, "export": cmd_export}[args.command]
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
    except KeyboardInterrupt as exc:  # outside a run (a run says more, in cmd_run)
        print("dtrain: terminated" if isinstance(exc, Terminated) else "dtrain: interrupted", file=sys.stderr)
        code = EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT
    if code in (EXIT_SIGINT, EXIT_SIGTERM) and args.command != "worker":  # (a worker stops its own processes)
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with ``code`` now (the command was interrupted and has cleaned up).

    CPython marks a KeyboardInterrupt raised while ``eval``/``exec`` runs a string (a namedtuple
    or dataclass being created, as ``import torch`` does many times) as unhandled even when it
    is caught, and then ends the process with SIGINT instead of its exit code (``exit_sigint`` in
    ``Py_RunMain``): a Ctrl-C during start-up exited -2, not 130. Only ``os._exit`` gets past it,
    so the exit handlers run first (multiprocessing's removes the forkserver's directory under
    /tmp, the embedded cluster's warm parent is stopped) and stdio and the logs are flushed.
    ``main`` is the process's entry point."""
    atexit._run_exitfuncs()  # each runs once: a second call finds none left
    if "dtrain.deploy.forkserver" in sys.modules:  # the embedded cluster's warm parent: no lingering
        sys.modules["dtrain.deploy.forkserver"].stop()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


def cmd_export(args: argparse.Namespace) -> int:
    from .chief.export import export, remove_partial
    from .chief.rundir import RunDirLock

    out, run_dir = Path(args.out), Path(args.run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory")
    existed = out.exists()
    try:
        with RunDirLock(run_dir):  # (no run writes or prunes its checkpoints meanwhile)
            index = export(run_dir, out, args.step)
    except BaseException:
        if not existed:
            remove_partial(out)
        raise
    tables = index["tables"]
    print(f"exported step {index['step']} ({index['checkpoint']}): model.pt and {len(tables)} table(s) -> {out}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from .spec.loading import load, locate

    spec = load(args.pipeline, overrides=args.overrides, scheduler=args.scheduler)
    try:
        # What `run` checks before it starts (the user's code imported, the data read): a plan
        # that `run` would refuse is refused here too, as a spec error (exit 2).
        # The plan is compiled once, by those checks (a graph pipeline's, which they do not
        # compile, here), then put on the scheduler's workers when there is one.
        from .chief.preflight import check_before_start
        from .plan.compiler import compile, on_workers

        _, plan = check_before_start(spec, embedded=spec.cluster.scheduler is None)
        if plan is None:
            plan = compile(spec)
        if args.scheduler:
            from .deploy.cluster import connect

            with connect(spec, scheduler=args.scheduler, wait=False) as conn:
                plan = on_workers(plan, spec, conn.workers())
    except SpecError as exc:
        raise locate(exc, args.pipeline, args.overrides) from None
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.format())
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from .chief import signals

    # SIGINT, SIGTERM and SIGHUP become exceptions from the start: the run checkpoints and writes
    # its summary before exiting 130/143, and a signal while loading is a quiet exit, too.
    with signals.handled():
        try:
            return _run(args)
        finally:
            if args.profile_startup:
                from .deploy import phases

                print(phases.format_table(), file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from .chief import signals

    with signals.held():  # a Ctrl-C raised inside torch's import would abort the process (exit -6)
        if args.scheduler is None:  # the embedded cluster's worker parent imports torch beside this process
            from .deploy.forkserver import warm_for_file

            warm_for_file(args.pipeline, args.overrides)
        from .chief.rundir import check_run_dir, default_run_dir
        from .chief.runner import run
        from .deploy import phases
        from .spec.loading import load, locate

    if args.profile_startup:
        phases.start()
        phases.mark("python start, imports (torch, Dask)")
    spec = load(args.pipeline, overrides=args.overrides, scheduler=args.scheduler)
    _setup_logging(quiet=args.quiet)
    if args.profile_startup:
        phases.mark("validation")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(spec)
    check_run_dir(run_dir, args.resume)
    bar = _Progress(enabled=not args.quiet)
    try:
        result = run(spec, run_dir=run_dir, scheduler=args.scheduler, resume=args.resume, progress=bar.update)
    except SpecError as exc:  # found before start (the user's code, the data): give it its lines
        raise locate(exc, args.pipeline, args.overrides) from None
    except KeyboardInterrupt as exc:
        bar.close()
        what = str(exc) if isinstance(exc, Terminated) and str(exc) else (
            "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (SIGINT)")
        print(f"dtrain: {what}; {_interrupt_checkpoint(run_dir)}", file=sys.stderr)
        return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT
    finally:
        bar.close()
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


def _interrupt_checkpoint(run_dir: Path) -> str:
    """What the interrupted run left to resume from, for the one-line exit message."""
    try:
        written = json.loads((run_dir / "summary.json").read_text()).get("checkpoints") or []
    except (OSError, ValueError):
        written = []
    if written:
        return f"checkpoint {written[-1]} written: continue with --resume"
    return "no checkpoint written (add a checkpoint section to resume later)"


class _Progress:
    """A live progress bar on stderr (rich): step, loss, samples/s; the epoch with data.epochs or a
    sharded dataset (the bar then shows the share of the data consumed when the run ends with it)."""

    def __init__(self, enabled: bool):
        self._p: Progress | None = None
        self._task: TaskID | None = None
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
            self._by_share = "share" in info  # training.steps is unbounded: the data's end ends the run
            self._task = self._p.add_task("train", total=100 if self._by_share else info["steps"], info="")
        parts = []
        if info.get("epoch") is not None:
            parts.append(f"epoch {info['epoch']:.2f}" + (f" ({100 * info['share']:.0f}% of the data)"
                                                          if "share" in info else ""))
        if info.get("loss") is not None:
            parts.append(f"loss {info['loss']:.4f}")
        if info.get("samples_per_sec"):
            parts.append(f"{info['samples_per_sec']:.0f} samples/s")
        if info.get("dropped_stale"):
            parts.append(f"stale {info['dropped_stale']}")
        if info.get("elastic"):
            parts.append(f"replicas {info['replicas']}/{info['replicas_max']}")
        done = round(100 * info.get("share", 0)) if self._by_share else min(info["step"], info["steps"])
        assert self._task is not None
        self._p.update(self._task, completed=done, info="  ".join(parts))

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
    """`dtrain worker`: see :mod:`dtrain.deploy.worker`."""
    from .deploy.worker import main as worker_main

    return worker_main(args)


def entry() -> None:
    """The ``dtrain`` command's process: ``main``, its exit handlers, then an exit that skips the
    interpreter's teardown of its modules (0.6 s with torch imported, 1.6 s after a run: nothing
    of the run's is left to do by then; the streams and logs are flushed)."""
    _exit_now(main())


if __name__ == "__main__":
    entry()
