"""The ``gradtrack`` command: compare runs' gradient flow, whatever tracker they were logged to.

    gradtrack compare RUN [RUN ...] [--json] [--parity] [--rtol R] [--layer L ...] [--out DIR]
    gradtrack report RUN
    gradtrack sync [SPOOL ...] [--timeout S]

A RUN is a W&B offline run directory, ``wandb:entity/project/run_id`` (public API), a
TensorBoard log dir (a folder of event files, or ``tensorboard:DIR``), or an MLflow run id or
``experiment/run-name``. A SPOOL is what a run left undelivered (the
warning at its close names it), or a folder of them (default: every spool left on this
machine). Exit status: 0, or 1 when ``--parity`` finds runs that part or ``sync`` could not
deliver everything, or 2 on an error.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from pathlib import Path

from gradtrack import __version__
from gradtrack.errors import GradtrackError
from gradtrack.report.compare import DEFAULT_RTOL
from gradtrack.report.data import RunData

DEFAULT_OUT = Path("gradtrack-report")


def read_run(spec: str, tracking_uri: str | None) -> RunData:
    from gradtrack.report.sources import (
        is_log_dir,
        read_mlflow_run,
        read_tensorboard_dir,
        read_wandb_api,
        read_wandb_offline,
    )

    if spec.startswith("wandb:"):
        return read_wandb_api(spec[len("wandb:") :], progress=_progress)
    if spec.startswith("tensorboard:"):
        return read_tensorboard_dir(Path(spec[len("tensorboard:") :]), progress=_progress)
    path = Path(spec)
    if is_log_dir(path):
        return read_tensorboard_dir(path, progress=_progress)
    if path.exists():
        return read_wandb_offline(path, progress=_progress)
    return read_mlflow_run(spec, tracking_uri, progress=_progress)


# When reading began, and the last progress line written off a terminal.
_clock = time.monotonic
_progress_clock = {"start": _clock(), "last": 0.0}


def _progress(label: str, done: int, total: int) -> None:
    """A bar on a terminal; elsewhere (a CI log) a line every 5 s once a read has taken
    that long, so a long read shows it is alive and a short one says nothing."""
    finished = bool(total) and done == total
    if not sys.stderr.isatty():
        now = _clock()
        clock = _progress_clock
        if now - clock["start"] >= 5.0 and now - clock["last"] >= 5.0 and not finished:
            clock["last"] = now
            of = f"/{total}" if total else ""
            sys.stderr.write(f"gradtrack: {label}: {done}{of}\n")
        return
    if total:
        filled = int(30 * done / total)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
    else:
        sys.stderr.write(f"\r{label}: {done} rows")
    if finished:
        sys.stderr.write("\n")
    sys.stderr.flush()


def check_layers(requested: list[str], runs: list[RunData]) -> None:
    """Every requested layer exists in some run; else an error naming the closest names."""
    known = list(dict.fromkeys(layer for run in runs for layer in run.layers))
    for layer in requested:
        if layer not in known:
            # A parameter's name (``4.weight``) or a part of it names its layer too.
            related = [name for name in known if name in layer or layer in name]
            close = list(dict.fromkeys(related + difflib.get_close_matches(layer, known, 5)))[:5]
            hint = f"; closest: {', '.join(close)}" if close else f"; layers: {known[:10]}"
            raise GradtrackError(f"no layer {layer!r} in the runs{hint}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtrack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"gradtrack {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, nargs, help_ in (
        ("compare", "+", "compare the gradient flow of several runs"),
        ("report", 1, "the gradient-flow report of one run"),
    ):
        command = commands.add_parser(name, help=help_)
        command.add_argument("runs", nargs=nargs, metavar="RUN")
        _report_options(command)
    sync = commands.add_parser(
        "sync",
        help="deliver what runs left in their spools",
        description="Deliver to their trackers the steps and alerts that runs left in their "
        "spools (a tracker away at close, a killed process), each once, then delete the "
        "spools. A line every few seconds shows the progress.",
    )
    _sync_options(sync)
    return parser


def _report_options(command: argparse.ArgumentParser) -> None:
    """What ``compare`` and ``report`` share: where runs are read, the report written, and
    how strictly statistics are compared."""
    command.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, then MLflow's)",
    )
    command.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for report.html and its PNGs (default: {DEFAULT_OUT}; with --json "
        "the report is written only when --out is given)",
    )
    command.add_argument(
        "--layer",
        "--layers",
        dest="layers",
        action="append",
        metavar="LAYER",
        help="a layer whose histograms to draw (repeat for more; default: first, middle "
        "and last); an unknown name is an error",
    )
    command.add_argument(
        "--json",
        action="store_true",
        help="print the summary (runs, first divergence per pair, ranking) as JSON",
    )
    command.add_argument(
        "--rtol",
        type=float,
        default=None,
        help=f"relative tolerance at which statistics differ (default {DEFAULT_RTOL}; "
        "0 with --parity)",
    )
    command.add_argument(
        "--parity",
        action="store_true",
        help="the runs should be identical: exact comparison (unless --rtol), exit 1 if "
        "any two part",
    )


def _sync_options(sync: argparse.ArgumentParser) -> None:
    """``sync``'s spools and how long it waits on one."""
    sync.add_argument(
        "spools",
        nargs="*",
        type=Path,
        metavar="SPOOL",
        help="a spool folder (the path the run's warning named) or a folder of spools; "
        "none: every spool on this machine ($GRADTRACK_SPOOL_DIR, else "
        "~/.cache/gradtrack/spool)",
    )
    sync.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up on a spool after this many seconds without progress (an "
        "unreachable tracker; default 300); the spool is kept",
    )


def run_sync(spools: list[Path], timeout_s: float) -> int:
    from gradtrack.delivery.spool import default_root
    from gradtrack.delivery.sync import spools_under, sync
    from gradtrack.log import show_in_terminal

    show_in_terminal()
    paths = [p for root in spools or [default_root()] for p in spools_under(root)]
    if not paths:
        print("gradtrack: nothing to sync", file=sys.stderr)
        return 0
    left = 0
    for path in paths:
        print(f"{path}:")
        result = sync(path, timeout_s)
        left += result.left
        if result.left:
            print(f"  {result.left} item(s) still undelivered; the spool is kept")
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "sync":
        try:
            return run_sync(args.spools, args.timeout)
        except GradtrackError as error:
            print(f"gradtrack: {error}", file=sys.stderr)
            return 2
    _progress_clock.update(start=_clock(), last=0.0)
    # MLflow draws a progress bar on stderr for every artifact it downloads.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    rtol = args.rtol if args.rtol is not None else (0.0 if args.parity else DEFAULT_RTOL)
    if rtol < 0:
        print("gradtrack: --rtol must be >= 0", file=sys.stderr)
        return 2
    from gradtrack.report.compare import summarise, terminal_summary, to_json

    try:
        runs = [read_run(spec, args.tracking_uri) for spec in args.runs]
        check_layers(args.layers or [], runs)
        summary = summarise(runs, rtol)
        out = args.out if args.out is not None or args.json else DEFAULT_OUT
        if out is not None:
            from gradtrack.report.render import render_report

            path = render_report(runs, out, args.layers, summary=summary)
    except GradtrackError as error:
        print(f"gradtrack: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(summary), indent=2, allow_nan=False))
    else:
        print(terminal_summary(summary, path))
    parted = any(d is not None for _, _, d in summary.pairs)
    return 1 if args.parity and parted else 0


if __name__ == "__main__":
    sys.exit(main())
